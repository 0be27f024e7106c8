"""GPU tests (marked ``gpu``; skipped without CUDA). Run on the device machine:

    python -m pytest -m gpu tests/test_gpu.py
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import traceback

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_verify_passes_on_cuda():
    from mcore_hooks.testing import model_parallel
    from mcore_hooks.verify import run_checks

    with model_parallel(tp=1):
        rows = run_checks(device="cuda")
    failed = [r for r in rows if not r.passed]
    assert rows and not failed, failed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_on_cuda_matches_float64(dtype):
    from mcore_hooks.kernels import linear_logprob_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab = 2048, 512, 32003
    x = torch.randn(n, hidden, device="cuda", generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) / hidden**0.5).to(dtype)
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    x.requires_grad_()
    w.requires_grad_()
    r = linear_logprob_entropy(x, w, y, temperature=0.8, chunk_size=512)
    (r.logprob.sum() + r.entropy.sum()).backward()
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logp = torch.log_softmax(xd @ wd.t() / 0.8, -1)
    lp = logp.gather(1, y[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp.sum() + ent.sum()).backward()

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert rel(r.logprob, lp.detach()) < 2e-6 and rel(r.entropy, ent.detach()) < 2e-6
    grad_tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert rel(x.grad, xd.grad) < grad_tol and rel(w.grad, wd.grad) < grad_tol


# --------------------------------------------------------------------------- no host syncs


def _hook_keywords(processor_batch):
    """A bf16 tiny GPTModel on the GPU and the hook's keywords from one forward of it."""
    from mcore_hooks import hooked_class
    from mcore_hooks.processors import FusedLogprobProcessor
    from mcore_hooks.testing import TinyModelConfig, build_tiny_model, stock_model_class, tiny_batch

    packed = processor_batch
    cfg = TinyModelConfig(tied=False, params_dtype=torch.bfloat16)
    model = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class("gpt"))).cuda()
    batch = tiny_batch(cfg, packed=packed, batch_size=3)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    if packed:
        p = batch["packed_seq_params"]
        p.cu_seqlens_q, p.cu_seqlens_kv = p.cu_seqlens_q.cuda(), p.cu_seqlens_kv.cuda()
    seen = {}

    def grab(**kwargs):
        seen.update(kwargs)
        return FusedLogprobProcessor()(**kwargs)

    model(**batch, output_processor=grab)
    return seen, batch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_kept_logit_gradient_is_scaled_in_float32_on_the_gpu(dtype):
    """The Triton pass scaling a fused loss's kept logit gradient by the upstream gradient:
    float32 products rounded once (torch's CUDA mul of a 16-bit tensor by a float32 scalar
    tensor rounds the scalar first), as the torch form does."""
    from mcore_hooks.kernels.passes.loss_op import _scaled_logit_grad

    g = torch.Generator(device="cuda").manual_seed(3)
    dz = (torch.randn(64, 5000, device="cuda", generator=g) * 1e-3).to(dtype)
    for grad in (1.0, 0.37, 1 / 3, 2.0**-3):
        t = torch.tensor(grad, device="cuda")
        assert torch.equal(_scaled_logit_grad(dz, t), (dz.float() * t).to(dtype))


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
def test_processors_never_synchronise_with_the_host(packed):
    """Forward and backward of every bundled processor and both integrations (Triton backend),
    labels given and derived, a per-sample temperature, the weight's gradient into main_grad
    with and without a declared upstream gradient, with torch's sync debug mode raising on any
    synchronising call."""
    import copy

    from mcore_hooks.integrations import NemoRLLogprobProcessor, VerlFusedProcessor
    from mcore_hooks.processors import (
        EntropyProcessor,
        FusedLogprobProcessor,
        LinearCEProcessor,
        LogprobEntropyProcessor,
        PolicyLossProcessor,
    )
    from mcore_hooks.testing import model_parallel

    def loss_of(out):
        if isinstance(out, dict):
            out = out.get("loss", out.get("logprobs"))
        elif isinstance(out, tuple):
            out = out[0]
        elif hasattr(out, "log_probs"):
            out = out.log_probs
        return out.float().sum()

    with model_parallel(tp=1):
        kwargs, batch = _hook_keywords(packed)
        samples = 3
        temperature = torch.linspace(0.5, 1.5, samples, device="cuda")
        shape = kwargs["labels"].shape
        policy_inputs = {"old_logprobs": -torch.rand(shape, device="cuda") * 3,
                         "advantages": torch.randn(shape, device="cuda")}
        processors = [
            FusedLogprobProcessor(temperature=temperature), EntropyProcessor(mask_from_labels=True),
            LogprobEntropyProcessor(as_tuple=True, temperature=0.7), LinearCEProcessor(),
            LinearCEProcessor(reduction="sum"), LinearCEProcessor(reduction="mean"),
            PolicyLossProcessor(temperature=temperature), VerlFusedProcessor(),
            NemoRLLogprobProcessor(temperature=0.7),
        ]
        weight = kwargs["output_layer"].weight
        for main_grad in ("off", "on", "declared"):
            config = copy.copy(kwargs["config"])
            config.gradient_accumulation_fusion = main_grad != "off"
            weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device="cuda")
            weight.grad_added_to_main_grad = False
            route = processors if main_grad == "off" else [
                LinearCEProcessor(reduction="sum", upstream_grad=1.0 if main_grad == "declared" else None),
                PolicyLossProcessor(upstream_grad=1.0 if main_grad == "declared" else None),
                LogprobEntropyProcessor(),
            ]
            for derived in (False, True):
                for processor in route:
                    hidden = kwargs["hidden_states"].detach().requires_grad_()
                    labels = None if derived else kwargs["labels"]
                    if isinstance(processor, NemoRLLogprobProcessor):
                        labels = kwargs["input_ids"]  # NeMo RL's labels=input_ids
                    call = dict(kwargs, hidden_states=hidden, labels=labels, config=config,
                                context=policy_inputs if isinstance(processor, PolicyLossProcessor) else None)
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        loss_of(processor(**call)).backward()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
            if main_grad != "off":
                assert weight.main_grad.abs().sum() > 0
        for name in ("main_grad", "grad_added_to_main_grad"):
            delattr(weight, name)


# --------------------------------------------------------------------------- torch.compile, CUDA graphs


def _compile_cases():
    from mcore_hooks.integrations import NemoRLLogprobProcessor, VerlFusedProcessor
    from mcore_hooks.processors import (
        EntropyProcessor,
        FusedLogprobProcessor,
        LinearCEProcessor,
        LogprobEntropyProcessor,
        PolicyLossProcessor,
    )

    return {
        "fused-logprob": FusedLogprobProcessor, "entropy": EntropyProcessor,
        "logprob-entropy": LogprobEntropyProcessor, "linear-ce": LinearCEProcessor,
        "policy": PolicyLossProcessor, "verl": VerlFusedProcessor,
        "nemo-rl": lambda: NemoRLLogprobProcessor(temperature=0.7),
    }


def _one_number(out):
    if isinstance(out, dict):
        return sum((i + 1) * v.float().sum() for i, v in enumerate(out.values())
                   if torch.is_tensor(v) and v.requires_grad)
    if hasattr(out, "log_probs"):
        return out.log_probs.sum() + 0.5 * out.entropy.sum()
    return out.float().sum()


@pytest.mark.parametrize("case", ["fused-logprob", "entropy", "logprob-entropy", "linear-ce",
                                  "policy", "verl", "nemo-rl"])
def test_every_processor_compiles_whole_with_inductor(case):
    """``torch.compile(fullgraph=True)`` (Inductor) around each processor on the Triton backend,
    the keywords from a bf16 GPTModel's forward: no graph break, and the eager values and
    gradients. The kernels are opaque ops that run the eager code; Inductor may only reorder
    the float32 masks and sums around them (1e-6), and the bf16 gradients are the ops' own."""
    from mcore_hooks.testing import model_parallel

    with model_parallel(tp=1):
        kwargs, _ = _hook_keywords(False)
        processor = _compile_cases()[case]()
        shape = kwargs["labels"].shape
        g = torch.Generator(device="cuda").manual_seed(0)
        context = {"old_logprobs": -torch.rand(shape, device="cuda", generator=g) * 3,
                   "advantages": torch.randn(shape, device="cuda", generator=g)}
        labels = kwargs["input_ids"] if case == "nemo-rl" else kwargs["labels"]
        call = dict(kwargs, labels=labels, context=context if case == "policy" else None)
        weight = kwargs["output_layer"].weight

        def step(h):
            return _one_number(processor(**dict(call, hidden_states=h)))

        torch._dynamo.reset()
        results = []
        for run in (step, torch.compile(step, fullgraph=True)):
            h = kwargs["hidden_states"].detach().clone().requires_grad_()
            weight.grad = None
            out = run(h)
            out.backward()
            results.append((out.detach(), h.grad, weight.grad))
        (a, ah, aw), (b, bh, bw) = results
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(bh, ah, rtol=0, atol=0)
        torch.testing.assert_close(bw, aw, rtol=0, atol=0)


def test_kernels_in_cuda_graphs_are_bitwise_eager():
    """``torch.cuda.make_graphed_callables`` (forward and backward captured) and
    ``torch.compile(mode="reduce-overhead")`` (CUDA graphs under Inductor) around the log-prob
    pass and the fused policy loss: replays give the eager results bit for bit."""
    from mcore_hooks.kernels import linear_logprob_entropy, linear_policy_loss

    g = torch.Generator(device="cuda").manual_seed(1)
    n, hidden, vocab = 1024, 256, 8191
    x = torch.randn(n, hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) / 16).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    tw = torch.rand(n, device="cuda", generator=g)
    inputs = {"old_logprobs": -torch.rand(n, device="cuda", generator=g) * 3,
              "advantages": torch.randn(n, device="cuda", generator=g)}

    def logprob(xx, ww):
        r = linear_logprob_entropy(xx, ww, y, temperature=0.9)
        return r.logprob, r.entropy

    def policy(xx, ww):
        return linear_policy_loss(xx, ww, y, token_weight=tw, inputs=inputs).loss

    def run(fn, xx, ww):
        out = fn(xx, ww)
        outs = out if isinstance(out, tuple) else (out,)
        gx, gw = torch.autograd.grad(sum(o.float().sum() * (i + 1) for i, o in enumerate(outs)), [xx, ww])
        return [o.detach().clone() for o in outs] + [gx.clone(), gw.clone()]

    for fn in (logprob, policy):
        eager = run(fn, x, w)
        graphed = torch.cuda.make_graphed_callables(fn, (x, w))
        torch._dynamo.reset()
        compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
        for wrapped in (graphed, compiled):
            for _ in range(3):  # warm-up, record, replay
                got = run(wrapped, x, w)
            for a, b in zip(eager, got):
                assert torch.equal(a, b)


# --------------------------------------------------------------------------- 2 GPUs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _param_gather_worker(rank: int, world: int, port: int, backport: bool, mode: str, out) -> None:
    """DP=2, sharded parameters gathered before each module's forward by a forward pre-hook:
    Megatron DDP with the distributed optimizer and ``overlap_param_gather`` (``mode="ddp"``;
    ``align_param_gather`` so no earlier hook dispatches the output layer's all-gather: each
    bucket is gathered only by its own module's pre-hook), or Megatron-FSDP (``mode="fsdp"``,
    whose unshard pre-hook takes kwargs). After each optimizer step the processor (which reads
    the output weight instead of calling output_layer.forward) runs first, the stock forward
    second; their log-probs must agree. ``mode="ddp-skip"`` is the negative control: the
    processors' pre-hook call is disabled, so the output weight is stale."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig

        from mcore_hooks import compat, enable_output_processor, hooked
        from mcore_hooks.processors import FusedLogprobProcessor

        if mode == "ddp-skip":  # what the processors did before: read the weight, run no hooks
            compat.run_forward_pre_hooks = lambda module, args, kwargs: (args, kwargs)
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(123)
        config = TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
            attention_dropout=0.0, params_dtype=torch.float32,
        )
        cls = hooked.backport_class(GPTModel) if backport else GPTModel
        model = cls(
            config, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=64,
            position_embedding_type="learned_absolute", share_embeddings_and_output_weights=False,
        ).cuda()
        if mode == "fsdp":
            from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
            from megatron.core.transformer.transformer_layer import TransformerLayer

            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=True, use_megatron_fsdp=True,
                data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True,
                overlap_param_gather=True, grad_reduce_in_fp32=True,
            )
            model = FullyShardedDataParallel(config, ddp_config, model, fsdp_unit_modules=[TransformerLayer])
        else:
            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                align_param_gather=True, grad_reduce_in_fp32=True,
                bucket_size=4096,  # several buckets, the output layer in its own
            )
            model = DistributedDataParallel(config, ddp_config, model)
        model = enable_output_processor(model)
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=0.05, use_distributed_optimizer=True,
                            params_dtype=torch.float32),
            [model],
        )
        g = torch.Generator(device="cuda").manual_seed(rank)
        b, s = 2, 32
        ids = torch.randint(0, 256, (b, s), device="cuda", generator=g)
        pos = torch.arange(s, device="cuda").expand(b, s)
        mask = torch.ones(b, 1, s, s, dtype=torch.bool, device="cuda").triu(1)
        labels = torch.randint(0, 256, (b, s), device="cuda", generator=g)
        errors = []
        for _ in range(3):
            model.zero_grad_buffer()
            opt.zero_grad()
            loss = model(ids, pos, mask, labels=labels).mean()
            loss.backward()
            model.finish_grad_sync()
            opt.step()
            # Right after the step the updated shards are not yet gathered: the processor runs
            # first, the stock forward (whose pre-hooks wait for every bucket) second.
            with torch.no_grad():
                logprob = model(ids, pos, mask, labels=labels, output_processor=FusedLogprobProcessor())
                stock = -model(ids, pos, mask, labels=labels)
            errors.append(((logprob - stock).abs().max() / stock.abs().max()).item())
        out.put((rank, errors, None))
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test with it
        out.put((rank, None, traceback.format_exc()))


def _run_param_gather(backport: bool, mode: str) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_param_gather_worker, args=(r, 2, port, backport, mode, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for rank, _, tb in results:
        assert tb is None, f"rank {rank}:\n{tb}"
    return [errors for _, errors, _ in results]


def _needs_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.parametrize("backport", [False, True], ids=["native-or-installed", "backport"])
def test_distributed_optimizer_overlap_param_gather(backport):
    _needs_two_gpus()
    for errors in _run_param_gather(backport, "ddp"):
        assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("backport", [False, True], ids=["native-or-installed", "backport"])
def test_skipping_the_pre_hooks_reads_stale_weights(backport):
    """Negative control: without running the output layer's pre-hooks, the processor reads the
    output weight before its all-gather. Natively and on the backport the processor is called
    before any of the layer's hooks, so ``ctx.output_layer_inputs()`` must run them."""
    _needs_two_gpus()
    from megatron.core.models.gpt import GPTModel

    from mcore_hooks import compat

    if not backport and not compat.has_native_hook(GPTModel):
        pytest.skip("no native hook on this release: the backport case covers it")
    per_rank = _run_param_gather(backport, "ddp-skip")
    print("stale-weight errors per rank:", per_rank)
    assert all(max(errors) > 1e-3 for errors in per_rank), per_rank


@pytest.mark.parametrize("backport", [False, True], ids=["native-or-installed", "backport"])
def test_megatron_fsdp_unshards_the_output_weight(backport):
    _needs_two_gpus()
    try:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import HAVE_MEGATRON_FSDP
    except ImportError:
        HAVE_MEGATRON_FSDP = False
    if not HAVE_MEGATRON_FSDP:
        pytest.skip("this Megatron Core release ships no Megatron-FSDP")
    for errors in _run_param_gather(backport, "fsdp"):
        assert max(errors) < 1e-5, errors


# --------------------------------------------------------------------------- main_grad


def _main_grad_worker(port: int, tied: bool, dtype_name: str, declared: bool, out) -> None:
    """Megatron DDP (overlap_grad_reduce, fp32 grad buffers) on one GPU, two micro-batches of a
    GRPO loss: the stock path (logits, log_softmax, the loss) against PolicyLossProcessor with
    ``gradient_accumulation_fusion`` on (its output-weight gradient added into main_grad in the
    backward, or in the forward with the upstream gradient declared; the weight marked as
    Megatron's layers mark it). Returns each parameter's
    main_grad difference, relative, after both micro-batches and the gradient sync."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        from mcore_hooks import PolicyLossProcessor, compat, enable_output_processor
        from mcore_hooks.kernels import PolicyLoss

        dtype = getattr(torch, dtype_name)
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=120))
        parallel_state.initialize_model_parallel(1, 1)
        cfg = PolicyLoss(clip_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01)

        def build(fused):
            tensor_parallel.model_parallel_cuda_manual_seed(123)
            torch.manual_seed(123)
            config = TransformerConfig(
                num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
            )
            model = GPTModel(
                config, get_gpt_layer_local_spec(), vocab_size=1000, max_sequence_length=64,
                position_embedding_type="learned_absolute", share_embeddings_and_output_weights=tied,
            ).cuda()
            if dtype == torch.bfloat16:  # Megatron's bf16 wrapper: casts the inputs, floats the output
                from megatron.core.transformer.module import Float16Module

                model = Float16Module(config, model)
            ddp = DistributedDataParallel(
                config, DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True,
                                                      bucket_size=20000), model)
            # The layers read the flag when built (it needs apex's fused wgrad kernel for them);
            # the processor reads it at the call.
            config.gradient_accumulation_fusion = fused
            return enable_output_processor(ddp)

        g = torch.Generator(device="cuda").manual_seed(0)
        b, s = 2, 32
        batches = []
        for _ in range(2):
            ids = torch.randint(0, 1000, (b, s), device="cuda", generator=g)
            labels = torch.randint(0, 1000, (b, s), device="cuda", generator=g)
            inputs = {"old_logprobs": -torch.rand(b, s, device="cuda", generator=g) * 7,
                      "advantages": torch.randn(b, s, device="cuda", generator=g),
                      "ref_logprobs": -torch.rand(b, s, device="cuda", generator=g) * 7}
            batches.append((ids, labels, inputs))
        pos = torch.arange(s, device="cuda").expand(b, s)
        mask = torch.ones(b, 1, s, s, dtype=torch.bool, device="cuda").triu(1)

        def run(fused):
            model = build(fused)
            model.zero_grad_buffer()
            for ids, labels, inputs in batches:
                if fused:
                    # declared: the schedule's 1 / num_microbatches, the weight's gradient then
                    # added into main_grad in the forward
                    proc = PolicyLossProcessor(loss=cfg, upstream_grad=1 / len(batches) if declared else None)
                    out = model(ids, pos, mask, labels=labels, output_processor=proc,
                                output_processor_context=inputs)
                    loss = out["loss"]
                else:
                    logits = model(ids, pos, mask).float()
                    logp = torch.log_softmax(logits, -1)
                    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
                    ent = -(logp.exp() * logp).sum(-1)
                    loss = cfg(lp, ent, **inputs).mean()
                (loss / len(batches)).backward()  # the schedule's 1 / num_microbatches
            model.finish_grad_sync()
            gpt = compat.unwrap_model(model)
            weight = gpt.shared_embedding_or_output_weight() if tied else gpt.output_layer.weight
            return {n: p.main_grad.clone() for n, p in gpt.named_parameters()}, weight.grad_added_to_main_grad

        ref, _ = run(False)
        got, flag = run(True)
        errors = {n: ((got[n] - ref[n]).norm() / ref[n].norm().clamp(min=1e-30)).item() for n in ref}
        out.put((errors, flag, None))
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test with it
        out.put((None, None, traceback.format_exc()))


@pytest.mark.parametrize("declared", [False, True], ids=["in-backward", "declared-upstream-grad"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gradient_accumulation_fusion_into_megatron_ddp(tied, dtype, declared):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_main_grad_worker, args=(_free_port(), tied, dtype, declared, out))
    p.start()
    errors, flag, tb = out.get(timeout=300)
    p.join(timeout=60)
    assert tb is None, tb
    assert flag  # the output weight was marked as Megatron's own layers mark it
    # fp32: float rounding of another summation order; bf16: the stock path's bf16 logits
    tol = 1e-4 if dtype == "float32" else 5e-2
    assert max(errors.values()) < tol, errors


def _ddp_steps_worker(port: int, dist_opt: bool, compiled: bool, declared: bool, out) -> None:
    """Megatron DDP on one GPU as a trainer runs it (``overlap_grad_reduce``, float32 gradient
    buffers, several buckets; the distributed optimizer on or off, its step between steps):
    two training steps of two micro-batches each, ``zero_grad_buffer`` before each, and a
    forward-only call with grad enabled (the old policy's log-probs) between the first step's
    backward and its optimizer step (Adam). The stock path (logits, log_softmax, the GRPO loss) against
    PolicyLossProcessor with ``gradient_accumulation_fusion`` (the output weight's gradient into
    main_grad in the backward, or in the forward with ``upstream_grad`` declared; the
    forward-only call then under ``torch.no_grad()``), eager or ``torch.compile``-d (the
    processor whole, inductor). Returns, per step, each parameter's reduced gradient difference
    (relative), and whether the output weight was marked in every step."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig

        from mcore_hooks import FusedLogprobProcessor, PolicyLossProcessor, compat, enable_output_processor
        from mcore_hooks.kernels import PolicyLoss

        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=120))
        parallel_state.initialize_model_parallel(1, 1)
        cfg = PolicyLoss(clip_high=0.28, kl_coef=0.05, entropy_coef=0.01)
        vocab = 1000

        def build(fused):
            tensor_parallel.model_parallel_cuda_manual_seed(123)
            torch.manual_seed(123)
            config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                       hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32)
            model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=64,
                             position_embedding_type="learned_absolute",
                             share_embeddings_and_output_weights=False).cuda()
            ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
                overlap_grad_reduce=True, grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt,
                bucket_size=20000), model)
            config.gradient_accumulation_fusion = fused  # read by the processor at the call
            # Adam (the distributed optimizer takes no other): a small step, and an eps that keeps
            # the update proportional to gradients near 0, so both paths stay on the same weights
            opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, adam_eps=1e-3,
                                                         params_dtype=torch.float32,
                                                         use_distributed_optimizer=dist_opt), [ddp])
            return enable_output_processor(ddp), opt

        g = torch.Generator(device="cuda").manual_seed(0)
        b, s = 2, 32
        batches = []
        for _ in range(4):
            ids = torch.randint(0, vocab, (b, s), device="cuda", generator=g)
            labels = torch.randint(0, vocab, (b, s), device="cuda", generator=g)
            inputs = {"old_logprobs": -torch.rand(b, s, device="cuda", generator=g) * 7,
                      "advantages": torch.randn(b, s, device="cuda", generator=g),
                      "ref_logprobs": -torch.rand(b, s, device="cuda", generator=g) * 7}
            batches.append((ids, labels, inputs))
        pos = torch.arange(s, device="cuda").expand(b, s)
        mask = torch.ones(b, 1, s, s, dtype=torch.bool, device="cuda").triu(1)
        policy = PolicyLossProcessor(loss=cfg, upstream_grad=0.5 if declared else None)
        logprob = FusedLogprobProcessor()
        if compiled:
            policy, logprob = torch.compile(policy, fullgraph=True), torch.compile(logprob, fullgraph=True)

        def run(fused):
            model, opt = build(fused)
            gpt = compat.unwrap_model(model)
            steps, marked = [], []
            for step in range(2):
                model.zero_grad_buffer()
                opt.zero_grad()
                for ids, labels, inputs in batches[2 * step: 2 * step + 2]:
                    if fused:
                        out = model(ids, pos, mask, labels=labels, output_processor=policy,
                                    output_processor_context=inputs)
                        loss = out["loss"]
                    else:
                        logits = model(ids, pos, mask).float()
                        logp = torch.log_softmax(logits, -1)
                        lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
                        ent = -(logp.exp() * logp).sum(-1)
                        loss = cfg(lp, ent, **inputs).mean()
                    (loss * 0.5).backward()  # the schedule's 1 / num_microbatches
                if fused:
                    marked.append(gpt.output_layer.weight.grad_added_to_main_grad)
                    # the old policy's log-probs of the next batch: a forward with no backward
                    with torch.no_grad() if declared else contextlib.nullcontext():
                        model(batches[-1][0], pos, mask, labels=batches[-1][1], output_processor=logprob)
                model.finish_grad_sync()
                steps.append({n: p.main_grad.clone() for n, p in gpt.named_parameters()})
                opt.step()
            return steps, marked

        ref, _ = run(False)
        got, marked = run(True)
        errors = [{n: ((g_[n] - r[n]).norm() / r[n].norm().clamp(min=1e-30)).item() for n in r}
                  for g_, r in zip(got, ref)]
        out.put((errors, marked, None))
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test with it
        out.put((None, None, traceback.format_exc()))


@pytest.mark.parametrize("declared", [False, True], ids=["in-backward", "declared-upstream-grad"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dist_opt", [False, True], ids=["ddp", "distributed-optimizer"])
def test_megatron_ddp_training_steps_eager_and_compiled(dist_opt, compiled, declared):
    """Two training steps through Megatron's own DDP and optimizer (see the worker): every
    parameter's reduced gradient matches the stock path's in both steps (float32: another
    summation order), and the output weight was marked by the hand-off (eager) or handed DDP a
    gradient to add (compiled: before, a compiled backward gave it no gradient at all, so DDP's
    hook never ran for it)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_ddp_steps_worker, args=(_free_port(), dist_opt, compiled, declared, out))
    p.start()
    errors, marked, tb = out.get(timeout=600)
    p.join(timeout=60)
    assert tb is None, tb
    assert marked == [not compiled] * 2  # eager marks the weight; compiled hands DDP a gradient
    for step in errors:
        assert max(step.values()) < 1e-4, step


def test_main_grad_under_cuda_graphs_is_refused_before_a_replay_can_lose_it():
    """``torch.compile(mode="reduce-overhead")`` records the compiled graph as a CUDA graph and
    replays it with its own copies of non-parameter inputs: the kernels' additions into
    main_grad would land in the recording's copy (measured on an H100: main_grad 0 from the
    recorded steps on), and a Python side effect (marking the weight) would not replay. The warm-up
    step is exact; recording is refused in the forward, before anything is added."""
    import sys
    import types

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from ddp_like import ddp_like

    from mcore_hooks import main_grad as mg
    from mcore_hooks.kernels import linear_logprob_entropy

    v, h, n = 256, 64, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    w0 = torch.randn(v, h, device="cuda", generator=g)
    x = torch.randn(n, h, device="cuda", generator=g)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    cfg = types.SimpleNamespace(gradient_accumulation_fusion=True)
    ref = w0.clone().requires_grad_()
    linear_logprob_entropy(x, ref, y, backend="torch").logprob.sum().backward()
    weight = torch.nn.Parameter(w0.clone())
    ddp = ddp_like(weight)

    def body(hh):
        routed, kw = mg.main_grad_route(weight, cfg)
        return linear_logprob_entropy(hh, routed, y, backend="torch", **kw).logprob.sum()

    torch._dynamo.reset()
    compiled = torch.compile(body, mode="reduce-overhead", fullgraph=True)
    with pytest.raises(Exception, match="under CUDA graphs"):
        for _ in range(5):
            ddp.zero_grad_buffer()
            compiled(x.clone().requires_grad_()).backward()
            torch.cuda.synchronize()
            assert ddp.calls == 1 and weight.grad is None
            torch.testing.assert_close(weight.main_grad, ref.grad, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- rollout parity and batch invariance


def _rollout_data(n=1024, hidden=512, vocab=32003, k=16, seed=0):
    """bf16 inputs, labels, k random ids per token (a teacher's top-k), and a kept set per token:
    the label and k - 1 other distinct ids (label + distinct offsets), the last 3 padded on odd
    rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) / hidden**0.5 * 4).bfloat16()
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    ids = torch.randint(0, vocab, (n, k), device="cuda", generator=g)
    offsets = torch.arange(k, device="cuda") * 977  # distinct modulo the vocabulary
    kept = (y[:, None] + offsets) % vocab
    odd = (torch.arange(n, device="cuda") % 2 == 1)[:, None] & (torch.arange(k, device="cuda") >= k - 3)
    return x, w, y, ids, torch.where(odd, -1, kept)


def _keep_mask(kept, shape):
    count = torch.zeros(shape, dtype=torch.long, device=kept.device)
    return count.scatter_add_(1, kept.clamp(min=0), (kept >= 0).long()) > 0  # padding adds 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rollout_paths_on_cuda_match_float64(backend):
    """Kept-set replay, recomputed truncation and selected ids on the GPU (bf16, both backends
    for the vocabulary pass), against float64: log-probs to float32 rounding, gradients to bf16's."""
    from mcore_hooks.kernels import Truncation, linear_logprob_entropy

    x, w, y, ids, kept = _rollout_data()
    xd, wd = x.double(), w.double()
    logits = xd @ wd.t() / 0.8
    full = torch.log_softmax(logits, -1)

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    for case in ("kept", "truncation", "nucleus", "selected"):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        opts = {"kept": dict(kept_ids=kept), "truncation": dict(truncation=Truncation(top_k=16, top_p=0.9)),
                "nucleus": dict(truncation=Truncation(top_k=-1, top_p=0.9)),  # by a floor
                "selected": dict(selected_ids=ids)}[case]
        r = linear_logprob_entropy(xg, wg, y, temperature=0.8, backend=backend, **opts)
        out = r.selected if case == "selected" else r.logprob
        out.sum().backward()
        if case == "selected":
            want = full.gather(1, ids)
            keep = None
        else:
            keep = torch.zeros_like(full, dtype=torch.bool)
            if case == "kept":
                keep = _keep_mask(kept, full.shape)
            else:
                top = logits.topk(16 if case == "truncation" else logits.shape[1], 1)
                srt, order = top.values.sort(1)
                cum = torch.softmax(srt, 1).cumsum(1)
                drop = cum <= 1 - 0.9
                drop[:, -1] = False
                keep.scatter_(1, top.indices.gather(1, order), ~drop)
                keep.scatter_(1, y[:, None], True)
            want = torch.where(keep, logits, -float("inf")).log_softmax(-1).gather(1, y[:, None]).squeeze(1)
        assert rel(out, want) < 3e-6, case
        xr, wr = xd.clone().requires_grad_(), wd.clone().requires_grad_()
        lr = xr @ wr.t() / 0.8
        if case == "selected":
            ref = torch.log_softmax(lr, -1).gather(1, ids)
        else:
            ref = torch.where(keep, lr, -float("inf")).log_softmax(-1).gather(1, y[:, None])
        ref.sum().backward()
        assert rel(xg.grad, xr.grad) < 3e-2 and rel(wg.grad, wr.grad) < 3e-2, case


def _assert_alone_as_in_calls(run, probe: int, fewer: tuple[int, ...]) -> None:
    """``run(rows)``'s per-token results (a list of tensors, token first) for tokens
    ``0..probe-1`` called alone are the same bits first and last in calls of up to 16384 tokens,
    and their first ``n`` in calls of ``n in fewer`` tokens."""
    alone = run(torch.arange(probe, device="cuda"))
    for n in (probe + 1, 128, 1000, 4096, 16384):
        first = run(torch.arange(n, device="cuda"))
        last = run(torch.cat([torch.arange(probe, n, device="cuda"), torch.arange(probe, device="cuda")]))
        for k, (a, b, c) in enumerate(zip(alone, first, last)):
            assert torch.equal(a, b[:probe]) and torch.equal(a, c[-probe:]), (n, k)
    for n in fewer:
        assert all(torch.equal(a[:n], b) for a, b in zip(alone, run(torch.arange(n, device="cuda")))), n


@pytest.mark.parametrize("given", ["none", "selected_ids", "kept_ids"])
def test_default_triton_path_is_batch_invariant(given):
    """The default Triton path, no mode asked for: a token's log-prob, entropy, selected or
    kept-set log-probs (fixed vocabulary segments added in order) and dX row (a vocabulary chunk
    fixed by H) are bitwise equal in calls of 1 to 16384 tokens, first in the call or last."""
    from mcore_hooks.kernels import linear_logprob_entropy

    x, w, y, ids, kept = _rollout_data(n=16384, hidden=256, vocab=32003)
    extra = {"none": {}, "selected_ids": {"selected_ids": ids}, "kept_ids": {"kept_ids": kept}}[given]
    probe = 7

    def run(rows):
        xg = x[rows].clone().requires_grad_()
        r = linear_logprob_entropy(xg, w, y[rows], backend="triton",
                                   **{k: t[rows] for k, t in extra.items()})
        sel = r.selected.sum() if r.selected is not None else 0.0
        (r.logprob.sum() + 0.5 * r.entropy.sum() + sel).backward()
        return [r.logprob, r.entropy, xg.grad] + ([r.selected] if r.selected is not None else [])

    _assert_alone_as_in_calls(run, probe, fewer=(1,))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_nucleus_by_floor_is_batch_invariant_on_cuda(engine):
    """A truncation without top-k (its set given by a floor, the torch backend's passes over
    it on fixed-shape blocks, on the default backend): a token's log-prob, entropy,
    ``label_outside`` and dX row are bitwise equal in calls of 1 to 16384 tokens, first or last."""
    from mcore_hooks.kernels import Truncation, linear_logprob_entropy

    x, w, y, _, _ = _rollout_data(n=16384, hidden=256, vocab=32003)
    t = Truncation(top_k=-1, top_p=0.9, min_p=0.001, engine=engine)

    def run(rows):
        xg = x[rows].clone().requires_grad_()
        r = linear_logprob_entropy(xg, w, y[rows], truncation=t)
        (r.logprob.sum() + 0.5 * r.entropy.sum()).backward()
        return [r.logprob, r.entropy, r.label_outside, xg.grad]

    _assert_alone_as_in_calls(run, 7, fewer=(1,))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_whole_vocabulary_top_p_is_batch_invariant_on_cuda_at_odd_call_sizes(engine):
    """At V = 151936 (the floor pass sorting 18 rows at a time; SGLang's rule summing each row)
    a token's results, ``label_outside`` and dX row are the same bits alone and in calls of 19,
    37 and 64 tokens (one-row groups, where the normaliser's sum used to be split otherwise), on
    a high-entropy head where top-p cuts deep in the row."""
    from mcore_hooks.kernels import Truncation, linear_logprob_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    v, h, n = 151936, 256, 64
    w = (torch.randn(v, h, device="cuda", generator=g) / h**0.5 / 4).bfloat16()
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    t = Truncation(top_k=-1, top_p=0.9, engine=engine)

    def run(rows):
        xg = x[rows].clone().requires_grad_()
        r = linear_logprob_entropy(xg, w, y[rows], truncation=t)
        (r.logprob.sum() + r.entropy.sum()).backward()
        return r.logprob.detach(), r.entropy.detach(), r.label_outside, xg.grad

    full = run(torch.arange(n, device="cuda"))
    for rows in ([n - 1], list(range(n - 19, n)), list(range(n - 37, n)), [18], [36]):
        rows = torch.tensor(rows, device="cuda")
        for k, (a, b) in enumerate(zip(run(rows), full)):
            assert torch.equal(a, b[rows]), (len(rows), k)


def test_a_request_with_vllms_defaults_is_the_same_bits_beside_any_neighbour_on_cuda():
    """vLLM's defaults (``top_k=-1, top_p=1, min_p=0``) keep the whole vocabulary: the plain
    statistics pass (the Triton kernels), alone or beside a request with top-p and no top-k
    (which goes by a floor), with top-k 50 (gathered), or another with the defaults."""
    from mcore_hooks.kernels import Truncation, linear_logprob_entropy

    x, w, y, _, _ = _rollout_data(n=64, hidden=256, vocab=151936)
    per = 32

    def run(other):
        n = per if other is None else 2 * per
        xg = x[:n].clone().requires_grad_()
        ks, ps = [-1] * per, [1.0] * per
        if other is not None:
            ks, ps = ks + [other[0]] * per, ps + [other[1]] * per
        r = linear_logprob_entropy(xg, w, y[:n], truncation=Truncation(top_k=ks, top_p=ps))
        (r.logprob.sum() + 0.5 * r.entropy.sum()).backward()
        return r.logprob[:per], r.entropy[:per], r.label_outside[:per], xg.grad[:per]

    alone = run(None)
    for other in ((-1, 0.9), (50, 0.9), (-1, 1.0)):
        for k, (a, b) in enumerate(zip(alone, run(other))):
            assert torch.equal(a, b), (other, k)


@pytest.mark.parametrize("loss", ["cross_entropy", "policy_loss"])
def test_default_fused_losses_are_batch_invariant(loss):
    """The fused losses' default path (Triton, gradients formed in the forward, chunks sized from
    the call; token weights that do not follow the batch): a token's log-prob, entropy and dX row
    are bitwise equal in calls of 1 to 16384 tokens, first in the call or last. Their logits and
    dX come from ``logits`` / ``hidden_grad``'s kernels, each row summed in one order (cuBLAS's
    logits rows changed at M = 1 and 2 at this very shape: git show 5992123:benchmarks/RESULTS.md)."""
    from mcore_hooks.kernels import PolicyLoss, linear_cross_entropy, linear_policy_loss

    x, w, y, _, _ = _rollout_data(n=16384, hidden=1024, vocab=32003)
    g = torch.Generator(device="cuda").manual_seed(1)
    old = -3 * torch.rand(x.shape[0], device="cuda", generator=g)
    adv = torch.randn(x.shape[0], device="cuda", generator=g)
    probe = 7

    def run(rows):
        xg = x[rows].clone().requires_grad_()
        wg = w.clone().requires_grad_()  # dW formed too: the chunks' products as in training
        if loss == "cross_entropy":
            linear_cross_entropy(xg, wg, y[rows], backend="triton").backward()
            return [xg.grad]
        r = linear_policy_loss(xg, wg, y[rows], token_weight=torch.full((len(rows),), 1e-3, device="cuda"),
                               loss=PolicyLoss(entropy_coef=0.01), backend="triton",
                               inputs={"old_logprobs": old[rows], "advantages": adv[rows]})
        r.loss.backward()
        return [r.logprob, r.entropy, xg.grad]

    _assert_alone_as_in_calls(run, probe, fewer=(1, 2))  # 1, 2: where cuBLAS's logits rows differed


def test_processors_through_the_hook_are_batch_invariant_by_default():
    """The README's claim through the public path: the hook's keywords from a bf16 tiny
    GPTModel's forward of 40 samples (a 32000-token vocabulary: 125 one-tile segments),
    handed to the bundled log-prob processors and the fused policy loss (default options,
    Triton chosen; the loss summed over tokens, so no token's weight follows the batch) whole
    and sliced to fewer samples: each sample's log-probs, entropies and hidden-state gradient
    are the same bits alone, first, or last in the batch."""
    from mcore_hooks import hooked_class
    from mcore_hooks.kernels import PolicyLoss
    from mcore_hooks.processors import FusedLogprobProcessor, LogprobEntropyProcessor, PolicyLossProcessor
    from mcore_hooks.testing import (TinyModelConfig, build_tiny_model, model_parallel,
                                     stock_model_class, tiny_batch)

    with model_parallel(tp=1):
        cfg = TinyModelConfig(tied=False, params_dtype=torch.bfloat16, vocab_size=32000)
        model = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class("gpt"))).cuda()
        batch = {k: v.cuda() if torch.is_tensor(v) else v
                 for k, v in tiny_batch(cfg, packed=False, batch_size=40).items()}
        seen = {}

        def grab(**kwargs):
            seen.update(kwargs)
            return FusedLogprobProcessor()(**kwargs)

        model(**batch, output_processor=grab)
        hidden = seen["hidden_states"].detach()

        def run(processor, samples):
            kw = dict(seen)
            h = hidden[:, samples].clone().requires_grad_()
            kw["hidden_states"] = h
            for key in ("labels", "loss_mask", "input_ids", "position_ids", "attention_mask"):
                if torch.is_tensor(kw.get(key)):
                    kw[key] = kw[key][samples]
            if torch.is_tensor(kw.get("decoder_input")):
                kw["decoder_input"] = kw["decoder_input"][:, samples]
            if isinstance(processor, PolicyLossProcessor):
                kw["context"] = {k: t[samples] for k, t in context.items()}  # forward's output_processor_context
            out = processor(**kw)
            parts = [out["logprobs"], out["entropy"]] if isinstance(out, dict) else [out]
            if isinstance(processor, PolicyLossProcessor):  # a sum: no token's weight follows the batch
                out["loss"].backward()
            else:
                sum(p.float().sum() for p in parts).backward()
            return [p.detach() for p in parts] + [h.grad.transpose(0, 1)]  # per sample first

        g = torch.Generator(device="cuda").manual_seed(3)
        shape = batch["labels"].shape
        context = {"old_logprobs": -3 * torch.rand(shape, device="cuda", generator=g),
                   "advantages": torch.randn(shape, device="cuda", generator=g)}
        for processor in (LogprobEntropyProcessor(), FusedLogprobProcessor(),
                          PolicyLossProcessor(loss=PolicyLoss(entropy_coef=0.01), aggregation="token-sum")):
            whole = run(processor, slice(0, 40))
            for i, part in ((0, slice(0, 1)), (0, slice(0, 7)), (39, slice(39, 40)), (6, slice(0, 7))):
                got = run(processor, part)
                j = i - part.start
                assert all(torch.equal(a[i], b[j]) for a, b in zip(whole, got)), (type(processor), i, part)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_batch_invariance_on_cuda_is_bitwise(backend):
    """With batch_invariant=True the same tokens' log-probs, entropies, selected and kept-set
    log-probs and hidden-state gradient rows are bitwise equal in calls of 7 to 16384 tokens;
    and the gather path's dW is the same from run to run."""
    from mcore_hooks.kernels import linear_logprob_entropy

    x, w, y, ids, kept = _rollout_data(n=16384, hidden=256, vocab=32003)
    probe = 7

    def run(n, **opts):
        rows = torch.cat([torch.arange(probe, n, device="cuda"), torch.arange(probe, device="cuda")])
        xg, wg = x[rows].clone().requires_grad_(), w.clone().requires_grad_()
        r = linear_logprob_entropy(xg, wg, y[rows], backend=backend, batch_invariant=True, **opts)
        extra = r.selected.sum() if r.selected is not None else 0.0
        (r.logprob.sum() + 0.5 * r.entropy.sum() + extra).backward()
        outs = [r.logprob, r.entropy, xg.grad] + ([r.selected] if r.selected is not None else [])
        return [o[-probe:] for o in outs], wg.grad

    for o in ({}, dict(selected_ids=ids), dict(kept_ids=kept)):
        base = None
        for n in (probe, 128, 1000, 4096, 16384):
            sub = {k: v[torch.cat([torch.arange(probe, n, device="cuda"), torch.arange(probe, device="cuda")])]
                   for k, v in o.items()}
            got, _ = run(n, **sub)
            if base is None:
                base = got
            assert all(torch.equal(a, b) for a, b in zip(base, got)), (list(o), n)
    sub = {"kept_ids": kept[:4096]}
    rows = torch.arange(4096, device="cuda")
    dws = []
    for _ in range(2):
        wg = w.clone().requires_grad_()
        linear_logprob_entropy(x[rows], wg, y[rows], backend=backend, batch_invariant=True,
                               **sub).logprob.sum().backward()
        dws.append(wg.grad)
    assert torch.equal(dws[0], dws[1])
