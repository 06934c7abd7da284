"""Benchmarks behind ``megafixed bench``: ``kernels`` (the fixed-code input against embedding tables,
swept over shapes, against the measured copy bandwidth) and ``train`` (a real config's step time,
tokens/s, MFU and peak memory, with a bare torch loop of the same model as the overhead baseline)."""
