"""The processor under Megatron's own schedules on 2 GPUs (marked ``gpu``; needs 2 GPUs).

1. Combined 1F1B: a bf16 MoE GPTModel (local spec, 4 experts, top-2, expert parallel 2, the
   alltoall dispatcher, ``overlap_moe_expert_parallel_comm=True``) runs several micro-batches
   through ``get_forward_backward_func()`` with ``LogprobEntropyProcessor(as_tuple=True)``: the
   schedule builds a plan per micro-batch and the plan's post-process node calls the processor.
   Its log-probs, entropies and every parameter's gradient must equal the same model's through
   the plain (non-overlapped) schedule, within bf16 rounding.
2. Pipeline parallel 2 (plain 1F1B, two stages, bf16): the processor runs on the last stage only,
   and its results and every parameter's gradient equal the single-stage run's.

Run:  python -m pytest -s -m gpu tests/test_gpu_schedule_plan.py   (prints the max differences)
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import traceback

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

SEQ, MICRO_BATCH, MICRO_BATCHES, VOCAB = 64, 2, 4, 512


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batches(rank: int, n: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), device="cuda", generator=g)
        out.append(dict(
            input_ids=tokens[:, :-1].contiguous(),
            position_ids=torch.arange(SEQ, device="cuda").expand(MICRO_BATCH, SEQ).contiguous(),
            attention_mask=torch.ones(MICRO_BATCH, 1, SEQ, SEQ, dtype=torch.bool, device="cuda").triu(1),
            labels=tokens[:, 1:].contiguous(),
            loss_mask=torch.ones(MICRO_BATCH, SEQ, device="cuda"),
        ))
    return out


class Collect:
    """forward_step_func and loss_func for Megatron's schedules, with the processor; keeps every
    micro-batch's log-probs and entropies and counts the processor's calls."""

    def __init__(self):
        from mcore_hooks.processors import LogprobEntropyProcessor

        self.results: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.calls = 0
        self.plans = 0  # micro-batches the schedule asked a plan for (the combined-1F1B path)
        inner = LogprobEntropyProcessor(as_tuple=True)

        def processor(**kwargs):
            self.calls += 1
            return inner(**kwargs)

        self.processor = processor

    def loss_func(self, *outputs):
        # The plain schedules pass the model's output as one argument; the combined-1F1B plan
        # unpacks a tuple into arguments (loss_func(*outputs)).
        logprobs, entropy = outputs[0] if len(outputs) == 1 else outputs
        self.results.append((logprobs.detach().float().clone(), entropy.detach().float().clone()))
        loss = -(logprobs.float().sum()) - 0.01 * entropy.float().sum()
        return loss, {"loss": loss.detach()}

    def forward_step(self, data_iterator, model, return_schedule_plan: bool = False):
        batch = next(data_iterator)
        if return_schedule_plan:
            self.plans += 1
            plan = model.build_schedule_plan(**batch, output_processor=self.processor)
            return plan, self.loss_func
        return model(**batch, output_processor=self.processor), self.loss_func


def _run_schedule(model, batches: list[dict], collect: Collect, forward_only: bool = False) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad(set_to_none=True)
    get_forward_backward_func()(
        forward_step_func=collect.forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        forward_only=forward_only,
    )
    torch.cuda.synchronize()
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double())
    return d.abs().max().item(), (d.norm() / b.double().norm().clamp(min=1e-30)).item()


def _compare(results_a, results_b, grads_a: dict, grads_b: dict) -> dict:
    assert len(results_a) == len(results_b) and results_a
    lp = max(_diff(a[0], b[0])[0] for a, b in zip(results_a, results_b))
    ent = max(_diff(a[1], b[1])[0] for a, b in zip(results_a, results_b))
    assert grads_a.keys() == grads_b.keys() and grads_a, (sorted(grads_a), sorted(grads_b))
    per = {n: _diff(grads_a[n], grads_b[n]) for n in grads_a}
    worst = max(per, key=lambda n: per[n][1])
    return dict(logprob_max_abs=lp, entropy_max_abs=ent, grad_max_abs=max(v[0] for v in per.values()),
                grad_max_rel=per[worst][1], worst_param=worst, params=len(per))


def _moe_config(overlap: bool):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
        num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
        moe_ffn_hidden_size=256, expert_model_parallel_size=2, moe_grouped_gemm=False,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, overlap_moe_expert_parallel_comm=overlap,
    )


def _gpt(config, num_experts=None, pre_process=True, post_process=True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mcore_hooks import enable_output_processor

    model = GPTModel(
        config, get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False),
        vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=pre_process,
        post_process=post_process, share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    # As Megatron's Float16Module does (the plan bypasses its forward, not its cast).
    return enable_output_processor(model.cuda().bfloat16())


def _combined_1f1b(rank: int) -> dict:
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    try:
        overlapped = _gpt(_moe_config(True), num_experts=4)
        plain = _gpt(_moe_config(False), num_experts=4)
        plain.load_state_dict(overlapped.state_dict())
        batches = _batches(rank, MICRO_BATCHES)
        a, b = Collect(), Collect()
        grads_a = _run_schedule(overlapped, batches, a)
        grads_b = _run_schedule(plain, batches, b)
        out = _compare(a.results, b.results, grads_a, grads_b)
        out.update(processor_calls=(a.calls, b.calls), plans=(a.plans, b.plans))
        return out
    finally:
        parallel_state.destroy_model_parallel()


def _mtp_plan(rank: int) -> dict:
    """A MoE GPTModel with one MTP layer (the most upstream's plan allows), expert parallel 2:
    the plan built and run directly (as upstream's plan tests run it), stock against the fused
    MTP loss through ``LinearCEProcessor``; the per-token loss, the MTP tracker and every
    gradient."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as P
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from mcore_hooks import enable_output_processor
    from mcore_hooks.processors import LinearCEProcessor

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    try:
        try:
            from megatron.core.pipeline_parallel.utils import set_streams

            set_streams()
        except ImportError:
            pass
        config = dataclasses.replace(_moe_config(False), mtp_num_layers=1, mtp_loss_scaling_factor=0.1)
        spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)

        def build():
            return GPTModel(
                config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                share_embeddings_and_output_weights=False, position_embedding_type="rope",
                mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
            ).cuda().bfloat16().train()

        stock = build()
        ours = enable_output_processor(build())
        ours.load_state_dict(stock.state_dict())
        batch = _batches(rank, 1)[0]

        def run(model, **hook):
            model.zero_grad(set_to_none=True)
            MTPLossLoggingHelper.tracker.clear()
            plan = model.build_schedule_plan(**batch, **hook)
            out = P.run(plan, None)
            P.run(None, plan, b_grad=torch.ones_like(out))
            torch.cuda.synchronize()
            tracked = {k: v.float().clone() for k, v in MTPLossLoggingHelper.tracker.items() if torch.is_tensor(v)}
            grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
            return out.detach().float(), tracked, grads

        out_a, tr_a, g_a = run(ours, output_processor=LinearCEProcessor())
        out_b, tr_b, g_b = run(stock)
        assert tr_a.keys() == tr_b.keys() and tr_a, (tr_a, tr_b)
        per = {n: _diff(g_a[n], g_b[n]) for n in g_b}
        assert g_a.keys() == g_b.keys()
        worst = max(per, key=lambda n: per[n][1])
        return dict(loss_max_abs=_diff(out_a, out_b)[0],
                    tracker_max_abs={k: _diff(tr_a[k], tr_b[k])[0] for k in tr_a},
                    tracker_stock={k: v.tolist() for k, v in tr_b.items()},
                    grad_max_rel=per[worst][1], worst_param=worst, params=len(per))
    finally:
        parallel_state.destroy_model_parallel()


def _dense_config(pp: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=4, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        pipeline_model_parallel_size=pp,
    )


def _pipeline_2(rank: int) -> dict:
    from megatron.core import parallel_state, tensor_parallel

    batches = _batches(0, MICRO_BATCHES)  # both ranks: the same data (one pipeline)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    try:
        full = _gpt(_dense_config(1))
        state = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in full.state_dict().items()}
        ref = Collect()
        ref_grads = _run_schedule(full, batches, ref)
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    try:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        first, last = stage == 0, stage == 1
        model = _gpt(_dense_config(2), pre_process=first, post_process=last)
        per_stage = 2  # of 4 layers

        def global_name(name: str) -> str:  # this stage's layer i is layer stage * 2 + i
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + stage * per_stage)
            return ".".join(parts)

        model.load_state_dict({k: state[global_name(k)] for k in model.state_dict()})
        got = Collect()
        grads = _run_schedule(model, batches, got)
        grads = {global_name(n): g for n, g in grads.items()}
        mine = {n: ref_grads[n] for n in grads}
        if last:
            out = _compare(got.results, ref.results, grads, mine)
        else:
            assert got.results == [] and got.calls == 0  # hidden states only; never called
            per = {n: _diff(grads[n], mine[n]) for n in grads}
            out = dict(grad_max_abs=max(v[0] for v in per.values()),
                       grad_max_rel=max(v[1] for v in per.values()), params=len(per))
        out.update(stage=stage, processor_calls=got.calls)
        return out
    finally:
        parallel_state.destroy_model_parallel()


def _worker(rank: int, port: int, part: str, queue) -> None:
    try:
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=300))
        try:
            part_fn = {"combined": _combined_1f1b, "pipeline": _pipeline_2, "mtp_plan": _mtp_plan}[part]
            queue.put((rank, part_fn(rank), None))
        finally:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test with it
        queue.put((rank, None, traceback.format_exc()))


def _on_two_gpus(part: str) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, part, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=540) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, _, tb in results:
        assert tb is None, f"rank {rank}:\n{tb}"
    rows = [r for _, r, _ in results]
    import megatron.core

    report = {"megatron_core": megatron.core.__version__, "part": part, "ranks": rows}
    print(json.dumps(report))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"schedule_plan_{part}_{megatron.core.__version__}.json"), "w") as f:
            json.dump(report, f, indent=1)
    return rows


# bf16 logits are never formed (fp32 in the kernel): log-probs differ only where the schedules
# ordered bf16 work differently; gradients are bf16 products, rounded once (2**-8 relative).
BF16_GRAD = 2.0**-7


def test_combined_1f1b_with_expert_parallel_equals_the_plain_schedule():
    from megatron.core.models.gpt import GPTModel

    if not hasattr(GPTModel, "build_schedule_plan"):
        pytest.skip("no combined-1F1B schedule plan before Megatron Core 0.14")
    for row in _on_two_gpus("combined"):
        assert row["processor_calls"] == (MICRO_BATCHES, MICRO_BATCHES)
        assert row["plans"] == (MICRO_BATCHES, 0)  # the overlapped run went through the plans
        assert row["logprob_max_abs"] < 1e-2 and row["entropy_max_abs"] < 1e-2, row
        assert row["grad_max_rel"] < BF16_GRAD, row


def test_pipeline_parallel_2_processor_on_the_last_stage_only():
    rows = _on_two_gpus("pipeline")
    by_stage = {row["stage"]: row for row in rows}
    assert by_stage[0]["processor_calls"] == 0 and by_stage[1]["processor_calls"] == MICRO_BATCHES
    for row in rows:
        assert row["grad_max_rel"] < BF16_GRAD, row
    last = by_stage[1]
    assert last["logprob_max_abs"] < 1e-2 and last["entropy_max_abs"] < 1e-2, last


def test_mtp_through_the_plan_uses_the_fused_loss_and_equals_stock():
    from megatron.core.models.gpt import GPTModel

    if not hasattr(GPTModel, "build_schedule_plan"):
        pytest.skip("no combined-1F1B schedule plan before Megatron Core 0.14")
    for row in _on_two_gpus("mtp_plan"):
        # Stock's logits are rounded to bf16, the fused kernel's are not: losses agree to bf16
        # rounding, and an acceptance (0.19) can differ where two logits tie in bf16.
        diffs, stock = row["tracker_max_abs"], row["tracker_stock"]
        assert row["loss_max_abs"] < 5e-2, row
        assert diffs.get("loss_values", diffs.get("values", 1.0)) < 5e-2, row
        if "correct_values" in diffs:
            assert diffs["total_values"] == 0, row
            assert diffs["correct_values"] <= 0.02 * max(stock["total_values"]), row
        assert row["grad_max_rel"] < 2e-2, row
