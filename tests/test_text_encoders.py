"""latentfast.encoders.TextEncoder on tiny random-weight transformers models built from small configs,
with tokenizers built in memory (no downloads): shapes, cutting to the attention mask, pooled outputs,
parity with the diffusers pipelines' own prompt-embedding functions (called on the same model and
tokenizer), determinism, dtype kept, identity, clear errors."""
from __future__ import annotations

import json
import string
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from latentfast.encoders import TextEncoder  # noqa: E402
from latentfast.errors import ArgumentTypeError, InvalidArgumentError  # noqa: E402

CAPTIONS = ["a cat", "dog dog zebra quick brown", "cat", ""]  # the second is longer than CLIP's 16 tokens
CLIP_LENGTH, T5_LENGTH = 16, 12


def clip_tokenizer(extra: str = ""):
    """A CLIP BPE tokenizer over letters (with a few merges), CLIP's special tokens, max length 16."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in string.ascii_lowercase + extra:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    merges = [("c", "a"), ("ca", "t</w>"), ("d", "o"), ("do", "g</w>")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return transformers.CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_LENGTH)


def t5_tokenizer():
    """A T5 (Unigram) tokenizer over letters; T5's tokenizers set no useful model_max_length."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [("▁" + c, -1.0) for c in string.ascii_lowercase] + [(c, -2.0) for c in string.ascii_lowercase]
    return transformers.T5Tokenizer(vocab=pieces, extra_ids=0)


def tiny_clip(cls="CLIPTextModel", seed=0, vocab_size=60, positions=CLIP_LENGTH):
    torch.manual_seed(seed)
    config = transformers.CLIPTextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                                         num_attention_heads=4, max_position_embeddings=positions, projection_dim=24,
                                         bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return getattr(transformers, cls)(config).eval()


def tiny_t5(seed=0):
    torch.manual_seed(seed)
    config = transformers.T5Config(vocab_size=60, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return transformers.T5EncoderModel(config).eval()


def pipeline_self(**parts):
    """What the diffusers pipelines' prompt functions read from ``self``."""
    return SimpleNamespace(tokenizer_max_length=CLIP_LENGTH, _execution_device=torch.device("cpu"), **parts)


def lengths_of(tokenizer, captions, max_length):
    return tokenizer(captions, padding="max_length", max_length=max_length, truncation=True,
                     return_tensors="pt").attention_mask.sum(1).tolist()


# -- parity with the pipelines ----------------------------------------------------------------------
def test_sd_clip_last_hidden_state_cut_to_the_mask():
    from diffusers import StableDiffusionPipeline

    model, tok = tiny_clip(), clip_tokenizer()
    got = TextEncoder(model, tok).encode(CAPTIONS)
    want, _ = StableDiffusionPipeline.encode_prompt(pipeline_self(tokenizer=tok, text_encoder=model), CAPTIONS,
                                                    torch.device("cpu"), 1, False)
    lengths = lengths_of(tok, CAPTIONS, CLIP_LENGTH)
    assert got.lengths == lengths and lengths[3] == 2  # the empty caption is BOS + EOS
    assert [tuple(e.shape) for e in got.embeds] == [(n, 32) for n in lengths]
    for e, w, n in zip(got.embeds, want, lengths):
        assert torch.equal(e, w[:n])
    uncut = TextEncoder(model, tok, cut_to_mask=False).encode(CAPTIONS)
    assert torch.equal(torch.stack(uncut.embeds), want)  # what the SD pipeline feeds its UNet
    ids = tok(CAPTIONS, padding="max_length", max_length=CLIP_LENGTH, truncation=True, return_tensors="pt").input_ids
    assert torch.equal(got.pooled, model(ids).pooler_output)


def test_sd3_clip_with_projection_penultimate_and_text_embeds():
    from diffusers import StableDiffusion3Pipeline

    model, tok = tiny_clip("CLIPTextModelWithProjection"), clip_tokenizer()
    got = TextEncoder(model, tok, hidden_state=-2).encode(CAPTIONS)
    owner = pipeline_self(tokenizer=tok, text_encoder=model, tokenizer_2=None, text_encoder_2=None)
    want, want_pooled = StableDiffusion3Pipeline._get_clip_prompt_embeds(owner, CAPTIONS, 1, torch.device("cpu"))
    assert got.pooled.shape == (4, 24) and torch.equal(got.pooled, want_pooled)  # text_embeds (the projection)
    for e, w, n in zip(got.embeds, want, got.lengths):
        assert torch.equal(e, w[:n])
    # the penultimate layer is not the last one (a wrong index would still have the right shape)
    last = TextEncoder(model, tok).encode(CAPTIONS)
    assert not torch.allclose(last.embeds[0], got.embeds[0])
    skip = TextEncoder(model, tok, hidden_state=-3).encode(CAPTIONS)  # clip_skip=1
    want_skip, _ = StableDiffusion3Pipeline._get_clip_prompt_embeds(owner, CAPTIONS, 1, torch.device("cpu"), clip_skip=1)
    assert torch.equal(skip.embeds[1], want_skip[1, : skip.lengths[1]])


def test_flux_clip_pooled_and_t5_sequence():
    from diffusers import FluxPipeline

    clip, clip_tok, t5, t5_tok = tiny_clip(), clip_tokenizer(), tiny_t5(), t5_tokenizer()
    owner = pipeline_self(tokenizer=clip_tok, text_encoder=clip, tokenizer_2=t5_tok, text_encoder_2=t5)
    pooled = TextEncoder(clip, clip_tok).encode(CAPTIONS).pooled
    assert torch.equal(pooled, FluxPipeline._get_clip_prompt_embeds(owner, CAPTIONS, 1, torch.device("cpu")))
    got = TextEncoder(t5, t5_tok, max_length=T5_LENGTH).encode(CAPTIONS)
    want = FluxPipeline._get_t5_prompt_embeds(owner, CAPTIONS, 1, T5_LENGTH, torch.device("cpu"), torch.float32)
    assert got.pooled is None
    lengths = lengths_of(t5_tok, CAPTIONS, T5_LENGTH)
    assert got.lengths == lengths and lengths[3] == 1  # the empty caption is just EOS
    for e, w, n in zip(got.embeds, want, lengths):
        assert torch.equal(e, w[:n])
    # the pipeline lets T5 attend to the pads; passing the mask is another computation
    masked = TextEncoder(t5, t5_tok, max_length=T5_LENGTH, pass_attention_mask=True).encode(CAPTIONS)
    assert not torch.allclose(masked.embeds[0], got.embeds[0])


def test_lumina2_gemma2_penultimate_with_the_mask_and_the_system_prompt():
    from diffusers import Lumina2Pipeline

    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=60, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                                       pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model, tok = transformers.Gemma2Model(config).eval(), t5_tokenizer()
    prefix = "system prompt <Prompt Start> "
    got = TextEncoder(model, tok, hidden_state=-2, max_length=24, pass_attention_mask=True, prefix=prefix).encode(CAPTIONS)
    owner = pipeline_self(tokenizer=tok, text_encoder=model)
    want, mask = Lumina2Pipeline._get_gemma_prompt_embeds(owner, [prefix + c for c in CAPTIONS], torch.device("cpu"), 24)
    assert got.pooled is None and got.lengths == mask.sum(1).tolist()
    for e, w, m in zip(got.embeds, want, mask.bool()):
        assert torch.equal(e, w[m])
    plain = TextEncoder(model, tok, hidden_state=-2, max_length=24, pass_attention_mask=True)
    assert plain.encode(CAPTIONS).lengths[0] < got.lengths[0] and plain.identity() != TextEncoder(
        model, tok, hidden_state=-2, max_length=24, pass_attention_mask=True, prefix=prefix).identity()


# -- behaviour ------------------------------------------------------------------------------------
def test_bfloat16_stays_bfloat16_and_matches_the_model():
    model, tok = tiny_clip().to(torch.bfloat16), clip_tokenizer()
    got = TextEncoder(model, tok, hidden_state=-2).encode(CAPTIONS[:2])
    assert got.embeds[0].dtype == torch.bfloat16 and got.pooled.dtype == torch.bfloat16
    ids = tok(CAPTIONS[:2], padding="max_length", max_length=CLIP_LENGTH, truncation=True, return_tensors="pt").input_ids
    direct = model(ids, output_hidden_states=True).hidden_states[-2]
    assert torch.equal(got.embeds[1], direct[1, : got.lengths[1]])


def test_deterministic_and_independent_of_the_batch():
    for encoder in (TextEncoder(tiny_clip(), clip_tokenizer()), TextEncoder(tiny_t5(), t5_tokenizer(), max_length=T5_LENGTH)):
        first, again = encoder.encode(CAPTIONS), encoder.encode(CAPTIONS)
        assert all(torch.equal(a, b) for a, b in zip(first.embeds, again.embeds))
        alone = encoder.encode([CAPTIONS[1]])
        torch.testing.assert_close(alone.embeds[0], first.embeds[1], rtol=1e-6, atol=1e-6)


def test_truncation_and_over_long_captions():
    model, tok = tiny_clip(), clip_tokenizer()
    long = " ".join(["zebra"] * 5)  # 25 letters + BOS/EOS: more than 16 tokens
    got = TextEncoder(model, tok).encode([long, "cat"])
    assert got.lengths == [CLIP_LENGTH, 3] and got.embeds[0].shape == (CLIP_LENGTH, 32)
    with pytest.raises(InvalidArgumentError, match=r"captions\[1\] is 32 tokens, more than max_length=16 \(1 such captions"):
        TextEncoder(model, tok, truncate=False).encode(["cat", long + " zebra"])
    assert TextEncoder(model, tok, truncate=False).encode(["cat"]).lengths == [3]


def test_identity():
    model, tok = tiny_clip(), clip_tokenizer()
    identity = TextEncoder(model, tok).identity()
    assert json.loads(json.dumps(identity)) == identity
    assert identity["class"] == "transformers.CLIPTextModel" and identity["dtype"] == "float32"
    assert identity["config"]["hidden_size"] == 32 and "transformers_version" not in identity["config"]
    assert TextEncoder(tiny_clip(), clip_tokenizer()).identity() == identity  # same weights, same stamp
    encoder = TextEncoder(model, tok)
    encoder.encode(CAPTIONS)  # tokenizing sets padding / truncation on the tokenizer: not part of the stamp
    assert encoder.identity() == identity
    assert TextEncoder(tiny_clip(seed=1), tok).identity()["weights_blake2b"] != identity["weights_blake2b"]
    changed = tiny_clip()
    with torch.no_grad():
        list(changed.parameters())[-1].view(-1)[3] += 1e-3  # one value of one tensor
    assert TextEncoder(changed, tok).identity()["weights_blake2b"] != identity["weights_blake2b"]
    assert TextEncoder(tiny_clip().to(torch.bfloat16), tok).identity()["dtype"] == "bfloat16"
    for other in (dict(hidden_state=-2), dict(max_length=8), dict(cut_to_mask=False), dict(pass_attention_mask=True)):
        assert TextEncoder(model, tok, **other).identity() != identity, other
    other_vocab = TextEncoder(tiny_clip(vocab_size=64), clip_tokenizer(extra="0")).identity()
    assert other_vocab["tokenizer"]["blake2b"] != identity["tokenizer"]["blake2b"]
    t5 = TextEncoder(tiny_t5(), t5_tokenizer(), max_length=T5_LENGTH).identity()
    assert t5["pooled"] is None and t5["max_length"] == T5_LENGTH


@pytest.mark.parametrize("captions, error, match", [
    ([], InvalidArgumentError, "captions must hold at least one caption, got an empty list"),
    ("a cat", ArgumentTypeError, "captions must be a list of str, got str"),
    (["a cat", 3], ArgumentTypeError, r"captions\[1\] must be a str, got int"),
    (["a cat", None], ArgumentTypeError, r"captions\[1\] must be a str, got NoneType"),
])
def test_caption_errors(captions, error, match):
    with pytest.raises(error, match=match):
        TextEncoder(tiny_clip(), clip_tokenizer()).encode(captions)


def test_construction_errors():
    with pytest.raises(ArgumentTypeError, match="model must be a transformers CLIPTextModel / "):
        TextEncoder(torch.nn.Linear(2, 2), clip_tokenizer())
    with pytest.raises(ArgumentTypeError, match="tokenizer must be a transformers tokenizer, got dict"):
        TextEncoder(tiny_clip(), {})
    with pytest.raises(InvalidArgumentError, match="max_length is required: the tokenizer sets no model_max_length"):
        TextEncoder(tiny_t5(), t5_tokenizer())
    with pytest.raises(InvalidArgumentError, match=r"hidden_state must index the model's 4 hidden states \(-4 .. 3\), got -5"):
        TextEncoder(tiny_clip(), clip_tokenizer(), hidden_state=-5)
    with pytest.raises(InvalidArgumentError, match="max_length must be an int >= 1, got 0"):
        TextEncoder(tiny_clip(), clip_tokenizer(), max_length=0)
