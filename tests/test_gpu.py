"""GPU tests (marked ``gpu``; skipped without CUDA). Run on the device machine:

    python -m pytest -m gpu tests/test_gpu.py
"""

from __future__ import annotations

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


# --------------------------------------------------------------------------- 2 GPUs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _overlap_param_gather_worker(rank: int, world: int, port: int, backport: bool, out) -> None:
    """DP=2, distributed optimizer with overlapped param all-gather: after an optimizer step the
    processor (which reads the output weight without calling output_layer.forward) must see the
    gathered, updated weights, i.e. equal the stock loss computed after it."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig

        from mcore_hooks import compat, enable_output_processor
        from mcore_hooks.processors import FusedLogprobProcessor

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
        cls = compat.backport_class(GPTModel) if backport else GPTModel
        model = cls(
            config, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=64,
            position_embedding_type="learned_absolute", share_embeddings_and_output_weights=False,
        ).cuda()
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
            grad_reduce_in_fp32=True, bucket_size=4096,  # several buckets, output layer in its own
        )
        model = enable_output_processor(DistributedDataParallel(config, ddp_config, model))
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
    except Exception:
        out.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("backport", [False, True], ids=["native-or-installed", "backport"])
def test_distributed_optimizer_overlap_param_gather(backport):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_overlap_param_gather_worker, args=(r, 2, port, backport, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for rank, errors, tb in results:
        assert tb is None, f"rank {rank}:\n{tb}"
        assert max(errors) < 1e-5, (rank, errors)
