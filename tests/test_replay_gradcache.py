"""FeatureGradientReplay: validation, finalize, non-finite values, autocast, the reused cotangent
arena, offload/commit/discard (single process; replay steps against plain backpropagation are in
test_replay_steps.py, the spawned ranks in test_replay_distributed.py)."""
from __future__ import annotations

import pytest
import torch

from latentfast.errors import NonFiniteReplayError, ReplayError
from latentfast.replay import (
    FeatureGradientReplay,
    FeatureGradientReplayResult,
    MultiEncoderMMD,
    selection_correction_factor,
)

SHAPES = {"a": (3, 4), "b": (2, 5)}


def _loss(attraction: bool = False) -> MultiEncoderMMD:
    loss = MultiEncoderMMD(SHAPES, teacher_attraction_weight=0.5 if attraction else 0.0)
    generator = torch.Generator().manual_seed(3)
    loss.update_reference({n: torch.randn(6, *s, generator=generator) for n, s in SHAPES.items()})
    return loss


def _features(rows: int, seed: int = 0, **override) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    features = {n: torch.randn(rows, *s, generator=generator) for n, s in SHAPES.items()}
    features.update(override)
    return features


def _cache(attraction=False, B=6, b=4, **kwargs) -> FeatureGradientReplay:
    return FeatureGradientReplay(_loss(attraction), target_local_samples=B, gradient_local_samples=b, **kwargs)


def _ids(rows, start=0):
    return [f"id{i}" for i in range(start, start + rows)]


# ---- constructor ---------------------------------------------------------------------------
def test_alias_names():
    import latentfast.replay

    with pytest.warns(DeprecationWarning, match="FeatureGradientReplay"):
        from latentfast.compat import MultiRepresentationFreshVideoGradCache, MultiRepresentationFreshVideoGradCacheResult
    assert MultiRepresentationFreshVideoGradCache is FeatureGradientReplay
    assert MultiRepresentationFreshVideoGradCacheResult is FeatureGradientReplayResult
    assert not hasattr(latentfast.replay, "MultiRepresentationFreshVideoGradCache")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(loss_module=object()), TypeError, "loss_module must be callable"),
        (dict(gradient_local_samples=0), ValueError, "0 < gradient_local_samples <= target_local_samples"),
        (dict(gradient_local_samples=7), ValueError, "0 < gradient_local_samples <= target_local_samples"),
        (dict(full_student_partial_gradient=False), ValueError, "full_student_partial_gradient=True"),
        (dict(feature_dtype=torch.float16), ValueError, "feature_dtype"),
        (dict(check_finite="never"), ValueError, "check_finite must be one of"),
    ],
)
def test_constructor_errors(kwargs, error, message):
    args = dict(loss_module=_loss(), target_local_samples=6, gradient_local_samples=4)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        FeatureGradientReplay(args.pop("loss_module"), **args)


# ---- add validation --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "features, error, message",
    [
        ([torch.randn(2, 3, 4)], TypeError, "must be a mapping"),
        ({"a": torch.randn(2, 3, 4)}, ValueError, "keys must be"),
        (_features(2, a=torch.randn(2, 12)), ValueError, r"\['a'\] must be a non-empty floating \[B, N, D\]"),
        (_features(2, a=torch.ones(2, 3, 4, dtype=torch.int64)), ValueError, "floating"),
        (_features(2, a=torch.randn(2, 0, 4)), ValueError, "non-empty"),
        (_features(2, a=[[1.0]]), ValueError, r"\['a'\] must be"),
        (_features(2, b=torch.randn(2, 5, 2)), ValueError, r"geometry \(5, 2\) != expected \(2, 5\)"),
        (_features(2, a=torch.full((2, 3, 4), float("nan"))), FloatingPointError, "non-finite"),
        (_features(2, b=torch.full((2, 2, 5), float("inf"))), FloatingPointError, "non-finite"),
        (_features(2, b=torch.randn(3, 2, 5)), ValueError, "share batch size and device"),
    ],
)
def test_add_rejects_bad_features(features, error, message):
    cache = _cache()
    with pytest.raises(error, match=message):
        cache.add(features, gradient_selected=False)
    assert cache.local_samples == 0


def test_add_overflowing_the_float32_cache_names_the_branch():
    """A finite float64 value beyond float32's range would be stored as inf: refused, and kept
    exactly by a float64 cache."""
    big = _features(2, b=torch.full((2, 2, 5), 1e39, dtype=torch.float64))
    cache = _cache()
    with pytest.raises(NonFiniteReplayError, match=r"generated_features\['b'\] is finite but exceeds the range"):
        cache.add(big, gradient_selected=False)
    assert cache.local_samples == 0 and cache._store is None
    wide = _cache(feature_dtype=torch.float64)
    wide.add(big, gradient_selected=False)
    assert torch.equal(wide._store_views(wide._store)[0]["b"][:2], big["b"])
    teacher = _cache(attraction=True)
    teacher.add(_features(2), gradient_selected=False)
    with pytest.raises(FloatingPointError, match=r"current_teacher_features\['b'\] is finite but exceeds"):
        teacher.add(_features(2), big, sample_ids=_ids(2), current_teacher_sample_ids=_ids(2))


def test_deferred_finite_check_reports_the_add_and_branch_at_finalize():
    """check_finite="finalize" (the default on GPUs: no host sync per add) stores the microbatch and
    makes finalize raise, naming the branch and the add."""
    cache = _cache(check_finite="finalize")
    cache.add(_features(2), gradient_selected=False)
    cache.add(_features(2, seed=1))
    cache.add(_features(2, seed=2, b=torch.full((2, 2, 5), float("nan"))))
    with pytest.raises(NonFiniteReplayError, match=r"generated_features\['b'\] of add #2 on rank 0 is not finite"):
        cache.finalize()
    cache.discard()
    teacher = _cache(attraction=True, check_finite="finalize")
    teacher.add(_features(2), gradient_selected=False)
    teacher.add(_features(2), _features(2, a=torch.full((2, 3, 4), 1e39, dtype=torch.float64)),
                sample_ids=_ids(2), current_teacher_sample_ids=_ids(2))  # fmt: skip
    teacher.add(_features(2), _features(2), sample_ids=_ids(2, 2), current_teacher_sample_ids=_ids(2, 2))
    with pytest.raises(NonFiniteReplayError, match=r"current_teacher_features\['a'\] of add #1"):
        teacher.finalize()


def test_add_capacity_suffix_and_ids():
    cache = _cache(B=8, b=4)
    cache.add(_features(2), gradient_selected=False)
    with pytest.raises(ValueError, match="exceeds target_local_samples"):
        cache.add(_features(7), gradient_selected=False)
    with pytest.raises(ValueError, match="exceeds the gradient suffix"):
        cache.add(_features(5))
    with pytest.raises(ValueError, match="one non-empty ID per row"):
        cache.add(_features(2), sample_ids=["x"])
    with pytest.raises(ValueError, match="one non-empty ID per row"):
        cache.add(_features(2), sample_ids=["x", ""])
    with pytest.raises(ValueError, match="current_teacher_sample_ids were given while"):
        cache.add(_features(2), current_teacher_sample_ids=_ids(2))
    with pytest.raises(ValueError, match="only accepted for selected microbatches with teacher attraction on"):
        cache.add(_features(2), _features(2))
    assert (cache.local_samples, cache.selected_local_samples) == (2, 0)  # failed adds stored nothing
    cache.add(_features(2, seed=1), sample_ids=_ids(2))
    with pytest.raises(ValueError, match="exceeds the gradient suffix"):
        cache.add(_features(3))
    with pytest.raises(ValueError, match="must form a suffix"):
        cache.add(_features(1), gradient_selected=False)
    assert (cache.local_samples, cache.selected_local_samples) == (4, 2)
    early = _cache(B=8, b=4)
    early.add(_features(3), gradient_selected=False)
    with pytest.raises(ValueError, match="unselected microbatches fill only the first .* 4 rows: 3 stored"):
        early.add(_features(2), gradient_selected=False)


def test_add_teacher_rules_with_attraction():
    cache = _cache(attraction=True, B=6, b=4)
    with pytest.raises(ValueError, match="only accepted for selected microbatches"):
        cache.add(_features(2), _features(2), gradient_selected=False)
    cache.add(_features(2), gradient_selected=False)
    with pytest.raises(ValueError, match="need sample_ids"):
        cache.add(_features(2), _features(2, seed=1))
    with pytest.raises(ValueError, match="sample IDs/order differ"):
        cache.add(_features(2), _features(2, seed=1), sample_ids=_ids(2), current_teacher_sample_ids=_ids(2)[::-1])
    with pytest.raises(ValueError, match="sample IDs/order differ"):
        cache.add(_features(2), _features(2, seed=1), sample_ids=_ids(2))
    with pytest.raises(ValueError, match="need current_teacher_features"):
        cache.add(_features(2), sample_ids=_ids(2), current_teacher_sample_ids=_ids(2))
    with pytest.raises(ValueError, match="batch size 3 != generated batch size 2"):
        cache.add(_features(2), _features(3), sample_ids=_ids(2), current_teacher_sample_ids=_ids(2))
    with pytest.raises(FloatingPointError, match="current_teacher_features"):
        bad = _features(2, a=torch.full((2, 3, 4), float("nan")))
        cache.add(_features(2), bad, sample_ids=_ids(2), current_teacher_sample_ids=_ids(2))
    assert cache.local_samples == 2
    # without alignment checks, ids are optional but teacher features are still required
    relaxed = _cache(attraction=True, B=6, b=4, require_sample_id_alignment=False)
    relaxed.add(_features(2), gradient_selected=False)
    relaxed.add(_features(2), _features(2, seed=1))
    with pytest.raises(ValueError, match="need current_teacher_features"):
        relaxed.add(_features(2))


def test_add_stores_detached_float32_copies():
    cache = _cache(B=3, b=1)
    source = {n: torch.randn(2, *s, dtype=torch.float64, requires_grad=True) * 1 for n, s in SHAPES.items()}
    cache.add(source, gradient_selected=False)
    cache.add({n: torch.randn(1, *s).to(torch.bfloat16) for n, s in SHAPES.items()})
    features, _ = cache._store_views(cache._store)
    assert cache._store.dtype == torch.float32 and not cache._store.requires_grad
    torch.testing.assert_close(features["a"][:2], source["a"].detach().float())
    with torch.no_grad():
        source["a"].add_(1.0)  # the cache holds a copy, not a view
    assert not torch.equal(features["a"][:2], source["a"].detach().float())


# ---- finalize ------------------------------------------------------------------------------
def _filled(attraction=False, loss_scale=1.0):
    cache = _cache(attraction=attraction, B=6, b=4, loss_scale=loss_scale)
    cache.add(_features(2, seed=0), gradient_selected=False)
    for seed, start in ((1, 2), (2, 4)):
        teacher = _features(2, seed=seed + 10) if attraction else None
        ids = _ids(2, start)
        cache.add(_features(2, seed=seed), teacher, sample_ids=ids, current_teacher_sample_ids=ids if attraction else None)
    return cache


def test_finalize_incomplete_raises():
    cache = _cache(B=6, b=4)
    cache.add(_features(2), gradient_selected=False)
    cache.add(_features(2))
    with pytest.raises(RuntimeError, match=r"incomplete dual GradCache: \(stored, selected\) = \(4, 2\)"):
        cache.finalize()
    with pytest.raises(RuntimeError, match="before finalize"):
        cache.offload_finalized_to_cpu()
    with pytest.raises(RuntimeError, match="before finalize"):
        cache.commit()


@pytest.mark.parametrize("attraction", [False, True])
def test_finalize_cotangents_match_autograd(attraction):
    cache = _filled(attraction, loss_scale=3.0)
    result = cache.finalize()
    assert cache.finalized and cache.finalize() is result
    with pytest.raises(RuntimeError, match="cannot add after finalize"):
        cache.add(_features(2))
    # direct evaluation: the same loss with the last four rows as leaves
    rows = [_features(2, seed=s) for s in range(3)]
    everything = {n: torch.cat([r[n] for r in rows]) for n in SHAPES}
    leaves = {n: everything[n][2:].clone().requires_grad_(True) for n in SHAPES}
    teacher = (
        {n: torch.cat([_features(2, seed=11)[n], _features(2, seed=12)[n]]) for n in SHAPES} if attraction else None
    )
    loss, _ = cache.loss_module(leaves, everything, teacher, torch.arange(2, 6))
    (loss * 3.0).backward()
    assert torch.equal(result.loss, loss.detach())  # the same operations on the same values
    assert torch.equal(result.optimized_loss, 3.0 * loss.detach())
    assert result.replay_batch_indices == (1, 2)
    assert result.replay_sample_ids == (tuple(_ids(2, 2)), tuple(_ids(2, 4)))
    for i, rows_ in enumerate((slice(0, 2), slice(2, 4))):
        for n in SHAPES:
            assert torch.equal(result.local_cotangents[i][n], leaves[n].grad[rows_])
            assert torch.equal(result.fsdp_cotangents[i][n], result.local_cotangents[i][n])  # world size 1
            assert result.local_cotangents[i][n].untyped_storage().data_ptr() == (
                result.cotangent_arena.untyped_storage().data_ptr()
            )
    assert result.local_cotangents[0]["a"].abs().sum() > 0
    m = result.metadata
    assert (result.local_samples, result.global_samples, result.gradient_local_samples) == (6, 6, 4)
    assert result.current_teacher_local_samples == (4 if attraction else 0) and result.world_size == 1
    for key, value in {
        "gradcache_local_samples": 6,
        "gradcache_global_samples": 6,
        "gradcache_forward_local_samples": 6,
        "gradcache_forward_global_samples": 6,
        "gradcache_gradient_local_samples": 4,
        "gradcache_gradient_global_samples": 4,
        "gradcache_current_teacher_local_samples": 4 if attraction else 0,
        "gradcache_current_teacher_global_samples": 4 if attraction else 0,
        "gradcache_kss_denominator": 36,
        "gradcache_partial_gradient_enabled": 1,
        "gradcache_full_student_partial_gradient": 1,
        "gradcache_world_size": 1,
        "gradcache_fsdp_cotangent_scale": 1.0,
        "loss_scale": 3.0,
    }.items():
        assert float(m[key]) == value, key
    assert m["gradcache_branch_names"] == ("a", "b")
    torch.testing.assert_close(m["raw_loss"], result.loss)
    assert set(m) >= {"mmd2/a", "mmd2/b", "bandwidth/a", "loss/a", "mmd2"}
    assert ("attraction/a" in m) == attraction
    assert selection_correction_factor(result) == 6 / 4


def test_offload_commit_discard():
    cache = _filled()
    finalized = cache.finalize()
    result = cache.offload_finalized_to_cpu()
    assert result is not finalized and cache.finalize() is result
    arena = result.cotangent_arena
    assert arena.device.type == "cpu"
    for part in result.local_cotangents + result.fsdp_cotangents:
        for n in SHAPES:
            assert part[n].untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    for i in range(2):
        for n in SHAPES:
            torch.testing.assert_close(result.local_cotangents[i][n], finalized.local_cotangents[i][n])
    before = [finalized.loss, finalized.optimized_loss, *[v for v in finalized.metadata.values() if torch.is_tensor(v)]]
    after = [result.loss, result.optimized_loss, *[v for v in result.metadata.values() if torch.is_tensor(v)]]
    for old, value in zip(before, after):
        assert value.device.type == "cpu" and torch.equal(value, old)
        assert value.data_ptr() != old.data_ptr()  # a copy, also from CPU tensors
    assert cache._store.device.type == "cpu"
    cache.commit()
    assert not cache.finalized and cache.local_samples == 0 and cache.selected_local_samples == 0
    assert cache._store is None
    # reusable after commit; discard works before and after finalize
    cache.add(_features(2), gradient_selected=False)
    cache.discard()
    assert cache.local_samples == 0 and cache._store is None
    cache = _filled()
    cache.finalize()
    cache.discard()
    assert not cache.finalized and cache._store is None


def _filled_step(seed: int):
    """(rows to add: one unselected microbatch then two selected ones, drawn from ``seed``; the
    expected cotangents of the four selected rows per branch, from autograd)."""
    rows = [_features(2, seed=seed + s) for s in range(3)]
    everything = {n: torch.cat([r[n] for r in rows]) for n in SHAPES}
    leaves = {n: everything[n][2:].clone().requires_grad_(True) for n in SHAPES}
    loss, _ = _loss()(leaves, everything, None, torch.arange(2, 6))
    loss.backward()
    return rows, {n: leaves[n].grad for n in SHAPES}


def _add_rows(cache, rows):
    cache.add(rows[0], gradient_selected=False)
    cache.add(rows[1])
    cache.add(rows[2])


@pytest.mark.parametrize("end_of_step", ["commit", "discard"])
def test_cotangent_arena_is_reused_across_steps(end_of_step):
    cache = _cache(B=6, b=4)
    rows, expected_first = _filled_step(0)
    _add_rows(cache, rows)
    first = cache.finalize()
    kept = first.local_cotangents[0]["a"]  # a tensor taken out during step 1
    pointer = first.cotangent_arena.data_ptr()
    getattr(cache, end_of_step)()
    # the result stays readable after commit/discard, until the next finalize reuses the arena
    torch.testing.assert_close(first.fsdp_cotangents[1]["b"], expected_first["b"][2:], rtol=0, atol=0)
    rows, expected = _filled_step(7)
    _add_rows(cache, rows)
    second = cache.finalize()
    assert second.cotangent_arena.data_ptr() == pointer  # same memory, no fresh pages
    assert second.local_cotangents[0]["a"] is kept  # and the same views, made once
    for i, rows_ in enumerate((slice(0, 2), slice(2, 4))):
        for n in SHAPES:
            torch.testing.assert_close(second.local_cotangents[i][n], expected[n][rows_], rtol=0, atol=0)
            torch.testing.assert_close(second.fsdp_cotangents[i][n], expected[n][rows_], rtol=0, atol=0)
    # step 1's result now refuses to be read (its arena too); a tensor taken out earlier holds
    # step 2's values
    assert first.expired and not second.expired
    with pytest.raises(ReplayError, match="overwritten"):
        first.local_cotangents[0]["a"]
    with pytest.raises(ReplayError, match="overwritten"):
        first.fsdp_cotangents[1]["b"]
    with pytest.raises(ReplayError, match="cotangent_arena was reused by a later finalize"):
        first.cotangent_arena
    assert "expired" in repr(first)  # the repr does not raise
    assert torch.equal(kept, expected["a"][:2])


def test_cotangent_arena_is_reused_with_another_microbatch_split():
    cache = _cache(B=6, b=4)
    rows, _ = _filled_step(0)
    _add_rows(cache, rows)  # selected microbatches of 2 and 2 rows
    first = cache.finalize()
    first.fsdp_cotangents[0]["a"]  # views made for the 2 + 2 split
    cache.commit()
    rows, expected = _filled_step(7)
    everything = {n: torch.cat([r[n] for r in rows]) for n in SHAPES}
    cache.add({n: everything[n][:2] for n in SHAPES}, gradient_selected=False)
    cache.add({n: everything[n][2:3] for n in SHAPES})
    cache.add({n: everything[n][3:] for n in SHAPES})  # now 1 + 3 rows
    pointer = first.cotangent_arena.data_ptr()
    second = cache.finalize()
    assert second.cotangent_arena.data_ptr() == pointer
    for i, rows_ in enumerate((slice(0, 1), slice(1, 4))):
        for n in SHAPES:
            assert second.fsdp_cotangents[i][n].shape == (rows_.stop - rows_.start, *SHAPES[n])
            torch.testing.assert_close(second.fsdp_cotangents[i][n], expected[n][rows_], rtol=0, atol=0)


def test_offloaded_result_survives_the_next_step():
    cache = _cache(B=6, b=4)
    rows, expected = _filled_step(0)
    _add_rows(cache, rows)
    cache.finalize()
    offloaded = cache.offload_finalized_to_cpu()  # on the CPU too, a copy out of the reused arena
    cache.commit()
    rows, _ = _filled_step(7)
    _add_rows(cache, rows)
    cache.finalize()
    for i, rows_ in enumerate((slice(0, 2), slice(2, 4))):
        for n in SHAPES:
            torch.testing.assert_close(offloaded.local_cotangents[i][n], expected[n][rows_], rtol=0, atol=0)


@pytest.mark.gpu
def test_offload_from_cuda_leaves_nothing_on_the_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    loss = MultiEncoderMMD(SHAPES)
    loss.update_reference({n: torch.randn(6, *s, device="cuda") for n, s in SHAPES.items()})
    cache = FeatureGradientReplay(loss, target_local_samples=4, gradient_local_samples=2)
    cache.add({n: v.cuda() for n, v in _features(2).items()}, gradient_selected=False)
    cache.add({n: v.cuda() for n, v in _features(2, seed=1).items()})
    assert cache.finalize().cotangent_arena.is_cuda
    result = cache.offload_finalized_to_cpu()
    tensors = [cache._store, result.loss, result.optimized_loss, result.cotangent_arena]
    tensors += [v for v in result.metadata.values() if torch.is_tensor(v)]
    tensors += [t for part in result.local_cotangents + result.fsdp_cotangents for t in part.values()]
    assert all(t.device.type == "cpu" for t in tensors)


@pytest.mark.gpu
def test_cuda_device_mismatch_rejected():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cache = _cache()
    with pytest.raises(ValueError, match="share batch size and device"):
        cache.add(_features(2, b=torch.randn(2, 2, 5, device="cuda")), gradient_selected=False)
    cache.add(_features(2), gradient_selected=False)
    with pytest.raises(ValueError, match="must share a device"):
        cache.add({n: v.cuda() for n, v in _features(2).items()}, gradient_selected=False)




# ---- b = B, autocast, non-finite loss and cotangents -------------------------------------------
def test_every_row_selected_is_plain_gradcache():
    cache = _cache(B=4, b=4)
    rows = [_features(2, seed=s, a=torch.randn(2, 3, 4, dtype=torch.float64)) for s in range(2)]
    for row in rows:
        cache.add(row)
    result = cache.finalize()
    everything = {n: torch.cat([r[n] for r in rows]).float() for n in SHAPES}
    leaves = {n: everything[n].clone().requires_grad_(True) for n in SHAPES}
    loss, _ = cache.loss_module(leaves, everything, None, torch.arange(4))
    loss.backward()
    assert torch.equal(result.loss, loss.detach()) and result.replay_batch_indices == (0, 1)
    assert result.gradient_local_samples == result.local_samples == 4
    for i, rows_ in enumerate((slice(0, 2), slice(2, 4))):
        # branch "a" was added in float64: its cotangents come back in float64
        assert result.local_cotangents[i]["a"].dtype == torch.float64
        assert torch.equal(result.local_cotangents[i]["a"], leaves["a"].grad[rows_].double())
        assert torch.equal(result.local_cotangents[i]["b"], leaves["b"].grad[rows_].double())
    assert selection_correction_factor(result) == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_finalize_under_autocast_keeps_float32_and_returns_the_feature_dtype(dtype):
    """Features added in half precision: the loss is evaluated in float32 even inside autocast
    (where the kernel matmuls would run in half precision), and the cotangents come back in the
    features' dtype, rounded once from the float32 gradient."""
    rows = [{n: v.to(dtype) for n, v in _features(2, seed=s).items()} for s in range(3)]
    results = []
    for context in (torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", enabled=False)):
        cache = _cache()
        _add_rows(cache, rows)
        with context:
            results.append(cache.finalize())
    inside, outside = results
    assert inside.loss.dtype == torch.float32 and torch.equal(inside.loss, outside.loss)
    everything = {n: torch.cat([r[n] for r in rows]).float() for n in SHAPES}
    leaves = {n: everything[n][2:].clone().requires_grad_(True) for n in SHAPES}
    loss, _ = _loss()(leaves, everything, None, torch.arange(2, 6))
    loss.backward()
    for i, rows_ in enumerate((slice(0, 2), slice(2, 4))):
        for n in SHAPES:
            assert inside.local_cotangents[i][n].dtype == dtype
            assert torch.equal(inside.local_cotangents[i][n], leaves[n].grad[rows_].to(dtype))
            assert torch.equal(inside.fsdp_cotangents[i][n], outside.fsdp_cotangents[i][n])


def test_non_finite_loss_names_the_branch():
    """Features of 1e30 are finite in float32, but their squared distances overflow: the loss and
    the cotangents would be NaN. finalize raises instead, naming the branch."""
    huge = _features(2, seed=1, b=torch.full((2, 2, 5), 1e30))
    cache = _cache()
    cache.add(_features(2), gradient_selected=False)
    cache.add(_features(2, seed=2))
    cache.add(huge)
    with pytest.raises(NonFiniteReplayError, match=r"the replay loss is not finite: branch 'b' \(.*mmd2/b=nan"):
        cache.finalize()
    assert not cache.finalized
    cache.discard()


def test_cotangent_overflowing_its_dtype_names_the_branch():
    """The float32 gradient is finite, but rounded to the features' float16 it is inf."""
    cache = _cache(loss_scale=1e12)
    rows = [{n: v.half() for n, v in _features(2, seed=s).items()} for s in range(3)]
    _add_rows(cache, rows)
    with pytest.raises(NonFiniteReplayError, match=r"cotangents of branch '(a|b)' are not finite in torch.float16"):
        cache.finalize()
    wide = _cache(loss_scale=1e12)  # the same in float32 fits
    _add_rows(wide, [{n: v.float() for n, v in row.items()} for row in rows])
    assert torch.isfinite(wide.finalize().cotangent_arena).all()


@pytest.mark.gpu
def test_adds_on_cuda_never_sync_and_finalize_reports_non_finite():
    """On a GPU the finiteness flags stay on the device (check_finite="auto"): add makes no host
    sync, and finalize reads every flag with its first collective."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    loss = MultiEncoderMMD(SHAPES)
    loss.update_reference({n: torch.randn(6, *s, device="cuda") for n, s in SHAPES.items()})
    rows = [{n: v.cuda() for n, v in _features(2, seed=s).items()} for s in range(3)]
    rows[2]["a"][0, 0, 0] = float("inf")
    cache = FeatureGradientReplay(loss, target_local_samples=6, gradient_local_samples=4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        cache.add(rows[0], gradient_selected=False)
        cache.add(rows[1])
        cache.add(rows[2])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(NonFiniteReplayError, match=r"generated_features\['a'\] of add #2"):
        cache.finalize()
