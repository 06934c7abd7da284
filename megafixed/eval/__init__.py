"""Zero-shot evaluation on the real benchmark sets, scored as lm-evaluation-harness scores them
(``megafixed eval``); an lm-eval model adapter (``lm_eval_adapter``); perplexity and bits per byte."""
