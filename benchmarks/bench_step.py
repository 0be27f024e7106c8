"""A training step through Megatron's own schedule and DDP on several GPUs: the stock path against
the bundled processors, per parallel layout, with every value and gradient compared.

    python benchmarks/bench_step.py [--gpus 4|2] [--configs tp4 ...] [--shape 0.5b|7b]
                                    [--layers N] [--rounds 8] [--json out.json]

One step: ``zero_grad_buffer``, ``get_forward_backward_func()`` over 4 micro-batches of 2 x 512
tokens (Megatron's DDP finalising the gradients, the distributed optimizer where the layout
asks), the optimizer's step. bf16 GPTModel (local layer spec), vocabulary 151936; ``0.5b``:
Qwen2.5-0.5B's shape (hidden 896, 24 layers, FFN 4864; 16 heads and 4 key-value groups so that
they split over 4 ranks), ``7b``: Qwen2.5-7B's (hidden 3584, 28 layers, FFN 18944, 28 heads, 4
groups). Two things stand in for what the GPU machine lacks (no Transformer Engine, no Apex):
the core attention is torch's ``scaled_dot_product_attention`` over each rank's own tokens
(context parallelism's ring attention is TE's; the same module in every path, so the paths
compare), and the norms are torch's (Megatron's fallback norm refuses sequence parallelism).
The MoE layouts take 4 experts, top-2, the all-to-all dispatcher, MoE FFN 1024.

Paths (the loss a sum over the tokens, the same objective for each pair):

* ``stock``: the model's own loss (``labels``: Megatron's vocab-parallel cross-entropy over
  ``[tokens, vocab]`` logits), summed;
* ``logprob``: ``LogprobEntropyProcessor(as_tuple=True)``, ``-sum(logprobs)``: equal to stock's;
* ``stock_policy``: PolicyLoss (clip 0.2 / 0.28) on the log-probs of stock's loss;
* ``policy``: ``PolicyLossProcessor`` (``token-sum``), the same loss;
* ``policy_main_grad``: the same with the output weight's gradient into Megatron's ``main_grad``
  (``gradient_accumulation_fusion`` given to the processor alone: Megatron's own layers would
  need Apex's fused kernel for it).

Reported per layout and path: the step's median ms over 8 steps (``--rounds``) after 2, the paths' steps
taken in turn (the slowest rank's),
the peak memory of the forward-backward beyond what was allocated before it (MiB, the largest
rank's; the optimizer's step, the same for every path, left out); and for each
processor against its stock pair after one forward-backward from the same weights: the largest
difference of a log-prob (where the pair has them), the relative difference (in norm) of the
output weight's ``main_grad`` and the largest of any parameter's (and which).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import socket
import statistics
import sys
import time
import traceback

import torch

SEQ, MICRO_BATCH, MICRO_BATCHES, VOCAB = 512, 2, 4, 151936

SHAPES = {
    # the LM head's share of a step at its largest: the shape of the first measurement
    "h512": dict(hidden_size=512, num_layers=2, ffn_hidden_size=2048, num_attention_heads=8,
                 num_query_groups=4),
    "0.5b": dict(hidden_size=896, num_layers=24, ffn_hidden_size=4864, num_attention_heads=16,
                 num_query_groups=4),
    "7b": dict(hidden_size=3584, num_layers=28, ffn_hidden_size=18944, num_attention_heads=28,
               num_query_groups=4),
}

# name: parallel layout (tp, pp, vpp, cp, ep, sequence parallel, MoE, DDP overlap + distributed optimizer)
CONFIGS = {
    "one_gpu": dict(),  # a check of the harness on one GPU
    # 4 GPUs
    "tp4": dict(tp=4),
    "tp2_sp_pp2": dict(tp=2, pp=2, sp=True),
    "tp2_cp2_sp": dict(tp=2, cp=2, sp=True),
    "pp4_vpp2": dict(pp=4, vpp=2),
    "dp2_tp2_overlap_distopt": dict(tp=2, overlap=True),
    "moe_ep4": dict(ep=4, moe=True),
    "moe_tp2_sp_ep2": dict(tp=2, ep=2, sp=True, moe=True),
    # 2 GPUs
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
    "pp2_vpp2": dict(pp=2, vpp=2),
    "cp2": dict(cp=2),
    "dp2_overlap_distopt": dict(overlap=True),
    "moe_ep2": dict(ep=2, moe=True),
}
DEFAULT_CONFIGS = {
    4: ["tp4", "tp2_sp_pp2", "tp2_cp2_sp", "pp4_vpp2", "dp2_tp2_overlap_distopt", "moe_ep4",
        "moe_tp2_sp_ep2"],
    2: ["tp2", "tp2_sp", "pp2", "pp2_vpp2", "cp2", "dp2_overlap_distopt", "moe_ep2"],
}
PATHS = ("stock", "logprob", "stock_policy", "policy", "policy_main_grad")
ROUNDS = 8  # timed steps of each path
PAIRS = {"logprob": "stock", "policy": "stock_policy", "policy_main_grad": "stock_policy"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the model


def _attention_class():
    from megatron.core.transformer.module import MegatronModule

    class SdpaAttention(MegatronModule):
        """Causal attention over this rank's own tokens ([s, b, np, hn] in, [s, b, np*hn]
        out), grouped-query heads repeated: torch's flash kernels, the same in every path."""

        def __init__(self, config, layer_number=1, attn_mask_type=None, attention_type="self",
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None, **kwargs):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None, **kwargs):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
            rep = q.shape[1] // k.shape[1]
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                   scale=self.softmax_scale)
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SdpaAttention


def _config(shape: str, layout: dict, layers: int):
    from megatron.core.transformer import TransformerConfig

    kw = dict(SHAPES[shape])
    if layers:
        kw["num_layers"] = layers
    if layout.get("moe"):
        kw.update(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                  moe_ffn_hidden_size=1024, moe_grouped_gemm=False,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  expert_model_parallel_size=layout.get("ep", 1))
        kw["num_layers"] = min(kw["num_layers"], 8)
    return TransformerConfig(
        **kw, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=layout.get("tp", 1), pipeline_model_parallel_size=layout.get("pp", 1),
        virtual_pipeline_model_parallel_size=layout.get("vpp"),
        context_parallel_size=layout.get("cp", 1), sequence_parallel=layout.get("sp", False),
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        use_cpu_initialization=False,
    )


def _build(config, layout: dict) -> list:
    """The model chunks of this rank (one; several with virtual pipeline stages), in Megatron's
    DDP, bf16."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules, get_num_layers_to_build)

    from mcore_hooks import enable_output_processor
    from mcore_hooks.testing.shims import CpuNorm

    layer = copy.deepcopy(get_gpt_layer_local_spec(num_experts=4 if layout.get("moe") else None,
                                                   moe_grouped_gemm=False))
    layer.submodules.input_layernorm = CpuNorm
    layer.submodules.pre_mlp_layernorm = CpuNorm
    layer.submodules.self_attention.submodules.core_attention = _attention_class()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=layout.get("overlap", False),
        use_distributed_optimizer=layout.get("overlap", False))
    chunks = []
    vpp = layout.get("vpp")
    for vp in range(vpp or 1):
        stage = vp if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        block = TransformerBlockSubmodules(
            layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=stage), layer_norm=CpuNorm)
        model = GPTModel(config, block, vocab_size=VOCAB, max_sequence_length=SEQ,
                         pre_process=pre, post_process=post,
                         share_embeddings_and_output_weights=False, position_embedding_type="rope",
                         vp_stage=stage).cuda().bfloat16()
        model = DistributedDataParallel(config, ddp_config, enable_output_processor(model))
        chunks.append(model)
    return chunks


# --------------------------------------------------------------------------- the data and paths


def _batches(layout: dict, seed: int) -> list[dict]:
    """This data-parallel rank's micro-batches (its own under DP / EP; one pipeline's the same),
    each context-parallel rank its own contiguous share of the sequence."""
    from megatron.core import parallel_state as ps

    g = torch.Generator(device="cuda").manual_seed(seed + 1000 * ps.get_data_parallel_rank())
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    s = SEQ // cp
    out = []
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), device="cuda", generator=g)
        old = -3 * torch.rand(MICRO_BATCH, SEQ, device="cuda", generator=g) - 9
        adv = torch.randn(MICRO_BATCH, 1, device="cuda", generator=g).expand(MICRO_BATCH, SEQ)
        part = slice(cp_rank * s, (cp_rank + 1) * s)
        out.append(dict(
            input_ids=tokens[:, :-1][:, part].contiguous(),
            position_ids=torch.arange(SEQ, device="cuda")[part].expand(MICRO_BATCH, s).contiguous(),
            labels=tokens[:, 1:][:, part].contiguous(),
            loss_mask=torch.ones(MICRO_BATCH, s, device="cuda"),
            old=old[:, part].contiguous(), adv=adv[:, part].contiguous()))
    return out


class Path:
    """forward_step_func and loss_func of one path; keeps the last step's per-token log-probs."""

    def __init__(self, name: str, fused_config=None):
        from mcore_hooks.kernels import PolicyLoss
        from mcore_hooks.processors import LogprobEntropyProcessor, PolicyLossProcessor

        self.name = name
        self.cfg = PolicyLoss(clip_low=0.2, clip_high=0.28)
        self.logprobs: list = []
        self.processor = None
        if name == "logprob":
            self.processor = LogprobEntropyProcessor(as_tuple=True)
        elif name.startswith("policy"):
            inner = PolicyLossProcessor(loss=self.cfg, aggregation="token-sum", as_tuple=True)
            if name == "policy_main_grad":  # the flag for the processor alone (see the docstring)
                def with_fusion(**kw):
                    return inner(**dict(kw, config=fused_config))

                self.processor = with_fusion
            else:
                self.processor = inner

    def forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        keys = ("input_ids", "position_ids", "labels")
        args = {k: batch[k] for k in keys}
        if self.processor is None:
            out = model(**args, attention_mask=None)
        else:
            context = {"old_logprobs": batch["old"], "advantages": batch["adv"]}
            out = model(**args, attention_mask=None, output_processor=self.processor,
                        output_processor_context=context)
        return out, lambda output: self.loss(output, batch)

    def loss(self, output, batch):
        mask = batch["loss_mask"]
        if self.name == "stock":
            lp = -output.float()
            loss = -(lp * mask).sum()
        elif self.name == "logprob":
            lp = output[0]
            loss = -(lp * mask).sum()
        elif self.name == "stock_policy":
            lp = -output.float()
            loss = (self.cfg(lp, None, old_logprobs=batch["old"], advantages=batch["adv"]) * mask).sum()
        else:
            loss, lp = output[0], output[1]
        self.logprobs.append(lp.detach().float().clone())
        return loss, {"loss": loss.detach()}


def _step(model: list, optimizer, path: Path, batches: list[dict], config, step: bool = True) -> float:
    """One step; returns the peak MiB allocated during its forward-backward beyond what was
    allocated before it (the optimizer's step, the same for every path, left out)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for m in model:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    path.logprobs = []
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    data = [iter(batches) for _ in model] if len(model) > 1 else iter(batches)
    cp = config.context_parallel_size
    get_forward_backward_func()(
        forward_step_func=path.forward_step, data_iterator=data, model=model if len(model) > 1 else model[0],
        num_microbatches=len(batches), seq_length=SEQ // cp, micro_batch_size=MICRO_BATCH,
        forward_only=False)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    if step:
        optimizer.step()
    return peak


# --------------------------------------------------------------------------- one layout


def _layout(name: str, shape: str, layers: int, paths: list[str], rounds: int = ROUNDS) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    layout = CONFIGS[name]
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.get("tp", 1), pipeline_model_parallel_size=layout.get("pp", 1),
        virtual_pipeline_model_parallel_size=layout.get("vpp"), context_parallel_size=layout.get("cp", 1),
        expert_model_parallel_size=layout.get("ep", 1))
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        config = _config(shape, layout, layers)
        model = _build(config, layout)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-7, bf16=True,
                            use_distributed_optimizer=layout.get("overlap", False)), model)
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        if layout.get("overlap"):
            config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
            config.grad_sync_func = [m.start_grad_sync for m in model] if len(model) > 1 else model[0].start_grad_sync
        fused_config = copy.copy(config)
        fused_config.gradient_accumulation_fusion = True
        batches = _batches(layout, seed=7)
        rows: dict = {}
        params = [(f"{i}.{n}", p) for i, m in enumerate(model) for n, p in m.named_parameters()]
        # exactness: one forward-backward (no optimizer step) from the same weights per path
        grads, logprobs = {}, {}
        for p_name in paths:
            path = Path(p_name, fused_config)
            _step(model, optimizer, path, batches, config, step=False)
            torch.cuda.synchronize()
            grads[p_name] = [p.main_grad.detach().float().clone() for _, p in params]
            logprobs[p_name] = [t for t in path.logprobs]
        for p_name, stock in PAIRS.items():
            if p_name not in grads or stock not in grads:
                continue
            rels = [((a - b).norm() / b.norm().clamp(min=1e-30)).item()
                    for a, b in zip(grads[p_name], grads[stock])]
            worst = max(range(len(rels)), key=rels.__getitem__)
            # the output layer's own: the gradient the paths form differently
            head = [r for (n, _), r in zip(params, rels) if "output_layer" in n]
            lp = max(((a - b).abs().max().item() for a, b in zip(logprobs[p_name], logprobs[stock])),
                     default=0.0)
            rows.setdefault(p_name, {}).update(grad_rel=rels[worst], worst_param=params[worst][0],
                                               head_grad_rel=max(head, default=0.0), logprob_abs=lp)
        del grads, logprobs
        # the paths' steps interleaved (round after round), so that drift of the machine's speed
        # falls on all of them alike
        objs = {p_name: Path(p_name, fused_config) for p_name in paths}
        times: dict = {p_name: [] for p_name in paths}
        peaks: dict = {p_name: 0.0 for p_name in paths}
        for round_ in range(2 + rounds):
            for p_name, path in objs.items():
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                peak = _step(model, optimizer, path, batches, config)
                torch.cuda.synchronize()
                if round_ >= 2:  # two rounds of warm-up
                    times[p_name].append((time.perf_counter() - t0) * 1e3)
                    peaks[p_name] = max(peaks[p_name], peak)
        for p_name in paths:
            rows.setdefault(p_name, {}).update(ms=statistics.median(times[p_name]), peak_mib=peaks[p_name])
        # the slowest rank's time, the largest rank's memory and difference
        for p_name, r in rows.items():
            for key in ("ms", "peak_mib", "grad_rel", "head_grad_rel", "logprob_abs"):
                if key in r:
                    t = torch.tensor([r[key]], device="cuda", dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    r[key] = t.item()
        del model, optimizer
        return rows
    finally:
        ps.destroy_model_parallel()
        torch.cuda.empty_cache()


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    try:
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
        from mcore_hooks.testing import quiet_megatron

        with quiet_megatron():
            for name in args.configs:
                try:
                    rows = _layout(name, args.shape, args.layers, args.paths, args.rounds)
                    if rank == 0:
                        queue.put((name, rows, None))
                except Exception:  # noqa: BLE001 - a benchmark row, reported, not a library path
                    if rank == 0:
                        queue.put((name, None, traceback.format_exc()))
                    raise
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        queue.put(("rank %d" % rank, None, traceback.format_exc()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS),
                    help="layouts (default: the 7 of 4 GPUs, or of 2 with --gpus 2)")
    ap.add_argument("--shape", default="0.5b", choices=list(SHAPES))  # h512: a small model, the head's share largest
    ap.add_argument("--layers", type=int, default=0, help="layers (default: the shape's)")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--json", default=None,
                    help="where the results go (default: benchmarks/results/step_<gpu>.json; the run of "
                         "this --shape replaces that shape's, the other shapes' stay)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="timed steps of each path")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for a layout")
    args = ap.parse_args()
    if args.configs is None:
        args.configs = DEFAULT_CONFIGS.get(args.gpus, ["one_gpu"])
    layers = args.layers or SHAPES[args.shape]["num_layers"]
    for name in args.configs:  # refused here, not by Megatron in every rank after the others start
        stages = CONFIGS[name].get("pp", 1) * (CONFIGS[name].get("vpp") or 1)
        if layers % stages:
            ap.error(f"{name}: {layers} layers do not split into {stages} pipeline stages "
                     f"(--layers a multiple of {stages}, e.g. --shape h512 --layers 8)")
    import torch.multiprocessing as mp

    print(f"{datetime.date.today()} {args.gpus} x {torch.cuda.get_device_name()} torch "
          f"{torch.__version__} command: {' '.join(sys.argv)}", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.gpus, port, args, queue)) for r in range(args.gpus)]
    for p in procs:
        p.start()
    results = {}
    failed = False
    for _ in args.configs:
        name, rows, tb = queue.get(timeout=args.timeout)
        if tb is not None:
            print(f"{name}: FAILED\n{tb}", flush=True)
            failed = True
            break
        results[name] = rows
        print(json.dumps({name: rows}), flush=True)
    for p in procs:
        if failed:  # the other ranks wait in a collective for the one that failed
            p.terminate()
        p.join(timeout=120)
    from report import default_path, run_meta, write_result  # benchmarks/report.py

    write_result(args.json or default_path("step"), "bench_step.py",
                 [{"meta": run_meta(gpu=f"{args.gpus} x {torch.cuda.get_device_name()}", shape=args.shape),
                   "results": results}], key="shape")
    print(f"| layout ({args.shape}) | " + " | ".join(f"{p} ms" for p in args.paths)
          + " | logprob / policy / policy_main_grad x stock | peak MiB (" + " / ".join(args.paths)
          + ") | output weight grad rel diff | max grad rel diff (param) | max logprob diff |")
    print("|---" * (len(args.paths) + 6) + "|")
    for name, rows in results.items():
        ms = [rows.get(p, {}).get("ms", math.nan) for p in args.paths]
        ratio = " / ".join(f"{rows[p]['ms'] / rows[PAIRS[p]]['ms']:.2f}" for p in PAIRS
                           if p in rows and PAIRS[p] in rows)
        peak = " / ".join(f"{rows.get(p, {}).get('peak_mib', math.nan):.0f}" for p in args.paths)
        worst = max((r for r in rows.values() if "grad_rel" in r), key=lambda r: r["grad_rel"], default={})
        head = max((r.get("head_grad_rel", 0.0) for r in rows.values()), default=0.0)
        lp = max((r.get("logprob_abs", 0.0) for r in rows.values()), default=0.0)
        print(f"| {name} | " + " | ".join(f"{m:.1f}" for m in ms) + f" | {ratio} | {peak} | "
              f"{head:.2e} | {worst.get('grad_rel', 0.0):.2e} ({worst.get('worst_param', '')}) | {lp:.2e} |")
    return 0 if len(results) == len(args.configs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
