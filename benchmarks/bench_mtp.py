"""Multi-token prediction's post-process, stock against the fused MTP loss (one GPU, bf16).

    python benchmarks/bench_mtp.py [--tokens 16384 --hidden 4096 --vocab 151936 --depths 2] [--out DIR]

A GPTModel (Megatron Core, local spec, 1 decoder layer, ``mtp_num_layers`` MTP layers, untied) is
given the hidden states its MTP block would produce, ``[(1 + depths) * s, b, h]`` (the main model's
and each depth's, concatenated as Megatron concatenates them), and runs its post-process
(``GPTModel._postprocess`` with ``mtp_in_postprocess=False``): every MTP depth's loss, logged and
scaled into the main hidden states, then the main head. So the decoder and MTP layers are not
timed; the part that builds ``[tokens, vocab]`` logits is. Methods:

* stock: the model's loss (Megatron's MTP loss per depth, then the main cross-entropy);
* stock MTP + LogprobEntropyProcessor: the processor at the main head, stock MTP (a processor
  without ``mtp_loss``), i.e. what a fused processor gives without the MTP hook;
* mcore-hooks: LogprobEntropyProcessor with its ``mtp_loss``: the fused kernel at every depth.

For each: median time (CUDA events, ``triton.testing.do_bench``), forward without grad and
forward+backward (gradients to the hidden states and every weight), and the peak memory allocated
beyond the inputs; and, once, the largest tensor any operator allocates (forward+backward).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
from typing import Any, Callable

import torch


def _setup():
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def _model(hidden: int, vocab: int, depths: int, seq: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=32, bf16=True,
        params_dtype=torch.bfloat16, mtp_num_layers=depths, mtp_loss_scaling_factor=0.1,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
    )
    spec = get_gpt_layer_local_spec()
    model = GPTModel(
        config, spec, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )
    return model.cuda().bfloat16().train()


def _largest_tensor(fn: Callable[[], None]) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.biggest = max(Largest.biggest, t.numel() * t.element_size())
            return out

    with Largest():
        fn()
    return Largest.biggest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--depths", type=int, default=2)
    ap.add_argument("--rep-ms", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import triton.testing

    from mcore_hooks import LogprobEntropyProcessor
    from mcore_hooks.mtp import MTPCalls, mtp_loss_hook

    _setup()
    s, b, h, v, d = args.tokens, 1, args.hidden, args.vocab, args.depths
    model = _model(h, v, d, s)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn((1 + d) * s, b, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    ids = torch.randint(0, v, (b, s), device="cuda", generator=g)
    labels = torch.randint(0, v, (b, s), device="cuda", generator=g)
    loss_mask = torch.ones(b, s, device="cuda")
    position_ids = torch.arange(s, device="cuda").unsqueeze(0)

    class StockMTP(LogprobEntropyProcessor):
        mtp_loss = None  # a processor without an MTP loss: stock MTP

    def post(processor: Any) -> Any:
        kwargs = dict(hidden_states=hidden, input_ids=ids, position_ids=position_ids, labels=labels,
                      rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                      mtp_in_postprocess=False, loss_mask=loss_mask)
        if processor is None:
            return model._postprocess(**kwargs)
        with MTPCalls(model) as calls, mtp_loss_hook(model, getattr(processor, "mtp_loss", None), calls):
            return model._postprocess(**kwargs, output_processor=processor)

    def objective(out: Any) -> torch.Tensor:
        if isinstance(out, dict):
            return out["logprobs"].sum() + out["entropy"].sum()
        return out.float().sum()

    methods = {
        "stock (MTP and main loss)": None,
        "stock MTP + LogprobEntropyProcessor": StockMTP(),
        "mcore-hooks: LogprobEntropyProcessor with fused MTP": LogprobEntropyProcessor(),
    }
    rows = []
    for name, processor in methods.items():
        def fwd():
            with torch.no_grad():
                post(processor)

        def fwd_bwd():
            model.zero_grad(set_to_none=True)
            hidden.grad = None
            objective(post(processor)).backward()

        row: dict[str, Any] = {"method": name}
        for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            fn()  # warm-up (compiles, allocates gradients)
            torch.cuda.synchronize()
            model.zero_grad(set_to_none=True)
            hidden.grad = None
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            row[f"{mode}_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            row[f"{mode}_ms"] = triton.testing.do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median")
        row["largest_tensor_mib"] = _largest_tensor(fwd_bwd) / 2**20
        rows.append(row)
        print(json.dumps(row), flush=True)
    import megatron.core

    meta = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "megatron_core": megatron.core.__version__,
        "shape": dict(tokens=s * b, hidden=h, vocab=v, depths=d), "command": " ".join(sys.argv),
    }
    print("\n| method | fwd ms | fwd extra MiB | fwd+bwd ms | fwd+bwd extra MiB | largest tensor MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['fwd_ms']:.1f} | {r['fwd_extra_mib']:.0f} | {r['fwd_bwd_ms']:.1f} | "
              f"{r['fwd_bwd_extra_mib']:.0f} | {r['largest_tensor_mib']:.0f} |")
    if args.out:
        with open(os.path.join(args.out, "bench_mtp.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
