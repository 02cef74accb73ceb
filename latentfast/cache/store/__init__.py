"""Where bytes live and how they get there durably: the format, the span table of item layouts, the durable append protocol, the writer and the reader."""
