"""A megafixed checkpoint as an lm-evaluation-harness model: ``--model megafixed --model_args
checkpoint=RUN_OR_CHECKPOINT[,tag=...,batch_size=...,device=...,dtype=...]``.

lm-eval 0.4 has no plug-in discovery for models (no entry points): a model exists once a module
calling ``@register_model`` has been imported. Importing this module registers ``megafixed``;
``python -m megafixed.eval.lm_eval_cli ...`` (the harness's own CLI, with this import first) is the
command-line way; in Python, ``import megafixed.eval.lm_eval_adapter`` before ``simple_evaluate``.

Scoring here is deliberately the harness's plain way, independent of ``megafixed.eval.scoring``
(no shared prefixes, no key/value cache): each request's ``(context + continuation)[-(max_len+1):][:-1]``
in length-sorted, right-padded batches, as ``HFLM._loglikelihood_tokens``. The equality test uses it
as the reference for our fast path; the benchmark compares the two.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm


@register_model("megafixed")
class MegafixedLM(TemplateLM):
    def __init__(self, checkpoint: str, tag: Optional[str] = None, tokenizer: Optional[str] = None,
                 batch_size: int | str = 32, device: Optional[str] = None, dtype: Optional[str] = None,
                 max_gen_toks: int = 256, **kwargs):
        super().__init__()
        from .load import load

        loaded = load(checkpoint, tag=tag, tokenizer=tokenizer, device=device, dtype=dtype)
        self.model, self.tok, self.cfg = loaded.model, loaded.tokenizer, loaded.cfg
        self._device = next(self.model.parameters()).device
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 32
        self.max_gen_toks = int(max_gen_toks)

    @property
    def device(self):
        return self._device

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod_id

    @property
    def max_length(self) -> int:
        return self.model.cfg.max_seq_len

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tok.decode(list(tokens))

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        results: list = [None] * len(requests)
        for s in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="megafixed lm-eval"):
            idx = order[s:s + self.batch_size]
            rows = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in idx]
            ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
            for b, r in enumerate(rows):
                ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
            logp = F.log_softmax(self.model(ids.to(self._device)).float(), dim=-1)
            for b, i in enumerate(idx):
                cont = requests[i][2][-self.max_length:]  # as megafixed.eval.scoring: see _model_input
                n = len(rows[b])
                lp = logp[b, n - len(cont):n]
                target = torch.tensor(cont, dtype=torch.long, device=lp.device)
                results[i] = (float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="megafixed rolling"):
            (string,) = req.args
            windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            out.append(sum(ll for ll, _ in scored))
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding until a stop string or ``max_gen_toks`` (a simple loop: generation tasks
        are not what megafixed evaluates; this keeps every harness task runnable)."""
        from ..model.generate import SamplingConfig, generate

        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="megafixed generate"):
            context, gen_kwargs = req.args
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context)[-(self.max_length - 1):] or [self.eot_token_id]
            new = generate(self.model, torch.tensor(ids), SamplingConfig(max_new_tokens=max_new,
                                                                         stop_id=self.eot_token_id))
            text = self.tok_decode([t for t in new if t != self.eot_token_id])
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out
