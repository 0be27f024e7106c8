"""The test-support builders run STOCK Megatron Core models on CPU, deterministically.

Covers every model class the installed Megatron Core has (gpt, hybrid, mamba), tied and untied:
loss / logits / hidden-state shapes, backward, same-seed determinism, packed THD batches equal to
running each sequence alone, and (in one spawn of 2 ranks) TP=2 with and without sequence
parallel equal to TP=1.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_hooks.testing import (
    TinyModelConfig,
    available_model_classes,
    build_tiny_model,
    cpu_shims_installed,
    model_parallel,
    packed_sequence_slices,
    run_on_ranks,
    stock_model_class,
    supports_packed_sequences,
    tiny_batch,
)


ALL_CLASSES = ("gpt", "hybrid", "mamba")
CASES = [(name, tied) for name in ALL_CLASSES for tied in (True, False)]
TP_ATOL = 1e-5


def _skip_if_unavailable(name: str) -> None:
    if name not in available_model_classes():
        pytest.skip(f"the installed Megatron Core has no {name!r} model class")


@pytest.fixture(scope="module")
def single_rank():
    """Megatron model parallel state (TP=1) in this process for the whole module."""
    with model_parallel():
        yield


def _objective(loss: torch.Tensor, batch: dict) -> torch.Tensor:
    mask = batch.get("loss_mask", torch.ones_like(loss))
    return (loss * mask).sum() / mask.sum()


def _assert_all_grads(model: torch.nn.Module) -> None:
    total = 0.0
    for name, param in model.named_parameters():
        assert param.grad is not None, f"no gradient for {name}"
        assert torch.isfinite(param.grad).all(), f"non-finite gradient for {name}"
        total += float(param.grad.float().norm())
    assert total > 0


def test_available_model_classes() -> None:
    names = available_model_classes()
    assert "gpt" in names and "mamba" in names  # in every supported release
    try:
        import megatron.core.models.hybrid.hybrid_model  # noqa: F401

        assert "hybrid" in names
    except ImportError:
        assert "hybrid" not in names
    for name in names:
        assert isinstance(stock_model_class(name), type)
    with pytest.raises(ValueError):
        stock_model_class("bert")


def test_build_needs_parallel_state() -> None:
    # In a fresh interpreter: this session's fixtures keep a parallel state alive.
    import subprocess
    import sys

    code = (
        "import pytest\n"
        "from mcore_hooks.testing import TinyModelConfig, build_tiny_model\n"
        "with pytest.raises(RuntimeError, match='model parallel state'):\n"
        "    build_tiny_model(TinyModelConfig())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("name,tied", CASES)
def test_forward_loss_logits_backward(single_rank, name: str, tied: bool) -> None:
    _skip_if_unavailable(name)
    cfg = TinyModelConfig(model_class=name, tied=tied)
    model = build_tiny_model(cfg)
    assert type(model) is stock_model_class(name)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    assert model.share_embeddings_and_output_weights is tied

    batch = tiny_batch(cfg, batch_size=2, seq_length=16)
    assert batch["input_ids"].shape == (2, 16) and batch["input_ids"].dtype == torch.int64
    assert int(batch["input_ids"].max()) < cfg.vocab_size
    assert batch["attention_mask"].dtype == torch.bool and batch["attention_mask"].shape == (
        2, 1, 16, 16
    )
    if "loss_mask" in batch:
        assert batch["loss_mask"].dtype == torch.float32
        assert 0 < float(batch["loss_mask"].sum()) < batch["loss_mask"].numel()

    loss = model(**batch)
    assert loss.shape == (2, 16) and loss.dtype == torch.float32
    assert torch.isfinite(loss).all()
    _objective(loss, batch).backward()
    _assert_all_grads(model)

    # attention_mask=None: the CPU core attention builds the causal mask itself (no CUDA mask).
    with torch.no_grad():
        torch.testing.assert_close(model(**dict(batch, attention_mask=None)), loss.detach())

    no_labels = tiny_batch(cfg, batch_size=2, seq_length=16, with_labels=False)
    assert "labels" not in no_labels and "loss_mask" not in no_labels
    with torch.no_grad():
        logits = model(**no_labels)
    assert logits.shape == (2, 16, cfg.vocab_size)
    # The loss is the cross-entropy of these logits.
    ref = torch.nn.functional.cross_entropy(
        logits.reshape(-1, cfg.vocab_size), batch["labels"].reshape(-1), reduction="none"
    ).view(2, 16)
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ALL_CLASSES)
def test_bf16_model(single_rank, name: str) -> None:
    _skip_if_unavailable(name)
    cfg = TinyModelConfig(model_class=name, params_dtype=torch.bfloat16)
    model = build_tiny_model(cfg)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    batch = tiny_batch(cfg)
    loss = model(**batch)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    with torch.no_grad():
        reference = build_tiny_model(TinyModelConfig(model_class=name))(**batch)
    torch.testing.assert_close(loss.detach(), reference, rtol=0, atol=0.05)
    _objective(loss, batch).backward()
    _assert_all_grads(model)


def test_sequence_parallel_needs_tp(single_rank) -> None:
    with pytest.raises(ValueError, match="sequence_parallel"):
        build_tiny_model(TinyModelConfig(sequence_parallel=True))


@pytest.mark.parametrize("name,tied", CASES)
def test_same_seed_same_weights(single_rank, name: str, tied: bool) -> None:
    _skip_if_unavailable(name)
    cfg = TinyModelConfig(model_class=name, tied=tied)
    cls = stock_model_class(name)
    subclass = type(f"Sub{cls.__name__}", (cls,), {})  # as a hooked subclass would be
    first, second = build_tiny_model(cfg), build_tiny_model(cfg, model_cls=subclass)
    assert type(second) is subclass

    def tensors(model: torch.nn.Module) -> dict:
        return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}

    a, b = tensors(first), tensors(second)
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key
    other = tensors(build_tiny_model(TinyModelConfig(model_class=name, tied=tied, seed=7)))
    assert any(not torch.equal(a[k], other[k]) for k in a)
    batch = tiny_batch(cfg)
    with torch.no_grad():
        assert torch.equal(first(**batch), second(**batch))


@pytest.mark.parametrize("name,tied", CASES)
def test_packed_thd_equals_separate_sequences(single_rank, name: str, tied: bool) -> None:
    _skip_if_unavailable(name)
    cfg = TinyModelConfig(model_class=name, tied=tied)
    if not supports_packed_sequences(name):
        with pytest.raises(NotImplementedError):
            tiny_batch(cfg, packed=True)
        pytest.skip(f"stock {stock_model_class(name).__name__}.forward has no packed_seq_params")
    model = build_tiny_model(cfg)
    batch = tiny_batch(cfg, batch_size=3, seq_length=8, packed=True)
    params = batch["packed_seq_params"]
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
    slices = packed_sequence_slices(batch)
    lengths = [s.stop - s.start for s in slices]
    assert len(set(lengths)) > 1 and sum(lengths) == batch["input_ids"].shape[1] == 24
    assert batch["attention_mask"] is None
    for s in slices:  # positions restart per sequence
        assert torch.equal(batch["position_ids"][0, s], torch.arange(s.stop - s.start))

    with torch.no_grad():
        packed_loss = model(**batch)
        assert packed_loss.shape == (1, 24)
        separate = []
        for s in slices:
            n = s.stop - s.start
            separate.append(
                model(
                    input_ids=batch["input_ids"][:, s],
                    position_ids=torch.arange(n).unsqueeze(0),
                    attention_mask=torch.ones(n, n, dtype=torch.bool).triu(1)[None, None],
                    labels=batch["labels"][:, s],
                )
            )
        torch.testing.assert_close(packed_loss, torch.cat(separate, dim=1), rtol=1e-5, atol=1e-5)
        # Sanity: without the packing information the later sequences see earlier ones.
        unpacked = dict(batch, packed_seq_params=None)
        unpacked["attention_mask"] = torch.ones(24, 24, dtype=torch.bool).triu(1)[None, None]
        assert not torch.allclose(model(**unpacked)[:, slices[1]], packed_loss[:, slices[1]])


@pytest.mark.parametrize("name,tied", CASES)
def test_hidden_states_without_post_process(single_rank, name: str, tied: bool) -> None:
    _skip_if_unavailable(name)
    cfg = TinyModelConfig(model_class=name, tied=tied, post_process=False)
    model = build_tiny_model(cfg)
    batch = tiny_batch(cfg, batch_size=2, seq_length=16, with_labels=False)
    hidden = model(**batch)
    assert hidden.shape == (16, 2, cfg.hidden_size)
    hidden.float().pow(2).mean().backward()
    assert model.embedding.word_embeddings.weight.grad is not None


def _cpu_attention(num_heads: int = 4):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_hooks.testing import CpuCoreAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8 * num_heads,
        num_attention_heads=num_heads,
        attention_dropout=0.0,
    )
    # pg_collection: a version-specific keyword SelfAttention passes; accepted and ignored.
    return CpuCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=None)


def test_cpu_core_attention_matches_sdpa_with_gqa(single_rank) -> None:
    attention = _cpu_attention()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 4, 8, generator=gen)  # [s, b, np, hn]
    k, v = torch.randn(2, 6, 2, 2, 8, generator=gen)  # 2 query groups
    out = attention(q, k, v, None)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3),
        k.repeat_interleave(2, dim=2).permute(1, 2, 0, 3),
        v.repeat_interleave(2, dim=2).permute(1, 2, 0, 3),
        is_causal=True,
    )
    torch.testing.assert_close(out, ref.permute(2, 0, 1, 3).reshape(6, 2, 32))
    # An explicit boolean mask (True = masked) is honoured as given.
    full = torch.zeros(1, 1, 6, 6, dtype=torch.bool)
    ref_full = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3),
        k.repeat_interleave(2, dim=2).permute(1, 2, 0, 3),
        v.repeat_interleave(2, dim=2).permute(1, 2, 0, 3),
    )
    out_full = attention(q, k, v, full)
    torch.testing.assert_close(out_full, ref_full.permute(2, 0, 1, 3).reshape(6, 2, 32))


def test_cpu_core_attention_thd_with_padding(single_rank) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    attention = _cpu_attention()
    lengths, padded = [3, 5, 2], [4, 6, 2]
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cu_padded = torch.tensor([0, 4, 10, 12], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=6,
        max_seqlen_kv=6,
    )
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 12, 4, 8, generator=gen)  # [t, np, hn]
    out = attention(q, k, v, None, packed_seq_params=params)
    assert out.shape == (12, 32)
    for start, n, n_pad in zip(cu_padded.tolist(), lengths, padded):
        s = slice(start, start + n)
        alone = attention(q[s, None], k[s, None], v[s, None], None)[:, 0]
        torch.testing.assert_close(out[s], alone)
        assert torch.all(out[start + n : start + n_pad] == 0)  # padding gives zeros


def test_shims_live_only_inside_their_scope(single_rank) -> None:
    import megatron.core.tensor_parallel.mappings as mappings

    assert cpu_shims_installed()  # single_rank's model_parallel() body is a scope
    assert mappings.torch is not torch  # redirected inside it


# ---------------------------------------------------------------------------------------------
# Tensor parallel: ONE spawn of 2 ranks does every TP check.
# ---------------------------------------------------------------------------------------------
def _run_case(cfg: TinyModelConfig, packed: bool) -> dict:
    """Loss, gradients of the (full or sharded) vocab weights, logits/hidden shapes."""
    model = build_tiny_model(cfg)
    batch = tiny_batch(cfg, batch_size=2, seq_length=16, packed=packed)
    loss = model(**batch)
    _objective(loss, batch).backward()
    out = {"loss": loss.detach()}
    out["embedding_grad"] = model.embedding.word_embeddings.weight.grad.clone()
    if not cfg.tied:
        out["output_grad"] = model.output_layer.weight.grad.clone()
    grads_ok = all(
        p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters()
    )
    out["grads_ok"] = grads_ok and sum(float(p.grad.norm()) for p in model.parameters()) > 0
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    out["norms_marked_sp"] = bool(norms) and all(
        getattr(p, "sequence_parallel", None) is cfg.sequence_parallel for p in norms
    )
    if not packed:
        with torch.no_grad():
            no_labels = tiny_batch(cfg, batch_size=2, seq_length=16, with_labels=False)
            out["logits_shape"] = tuple(model(**no_labels).shape)
            hidden_cfg = dataclasses.replace(cfg, post_process=False)
            out["hidden_shape"] = tuple(build_tiny_model(hidden_cfg)(**no_labels).shape)
    return out


def _tp_cases() -> list[tuple[str, bool, bool, bool]]:
    cases = []
    for name in available_model_classes():
        for tied in (True, False):
            for sp in (False, True):
                cases.append((name, tied, sp, False))
            if supports_packed_sequences(name):
                cases.append((name, tied, True, True))  # packed THD under TP + SP
    return cases


def _tp_rank_fn(cases: list[tuple[str, bool, bool, bool]]) -> dict:
    from megatron.core import parallel_state

    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    results = {}
    for name, tied, sp, packed in cases:
        cfg = TinyModelConfig(model_class=name, tied=tied, sequence_parallel=sp)
        results[(name, tied, sp, packed)] = _run_case(cfg, packed)
    return results


def test_tensor_parallel_2_matches_tp1(single_rank) -> None:
    cases = _tp_cases()
    per_rank = run_on_ranks(_tp_rank_fn, 2, cases)
    assert len(per_rank) == 2
    tp = 2
    for case in cases:
        name, tied, sp, packed = case
        ref = _run_case(TinyModelConfig(model_class=name, tied=tied), packed)
        ranks = [r[case] for r in per_rank]
        for rank, res in enumerate(ranks):
            label = f"{case} rank {rank}"
            assert res["grads_ok"], label
            assert res["norms_marked_sp"], label
            torch.testing.assert_close(res["loss"], ref["loss"], rtol=0, atol=TP_ATOL, msg=label)
            if not packed:
                assert res["logits_shape"] == (2, 16, 96 // tp), label
                s_local = 16 // tp if sp else 16
                assert res["hidden_shape"] == (s_local, 2, 32), label
        # TP shards of the vocab-parallel weights' gradients are slices of the TP=1 gradients
        # (exercises the SP all-gather / reduce-scatter backward on CPU).
        for key in ("embedding_grad", "output_grad"):
            if key in ref:
                full = torch.cat([res[key] for res in ranks], dim=0)
                msg = f"{case} {key}"
                torch.testing.assert_close(full, ref[key], rtol=0, atol=TP_ATOL, msg=msg)


def _raise_on_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 1 never joins: run_on_ranks must kill rank 0, not hang
    return dist.get_rank()


def test_run_on_ranks_reports_rank_traceback() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 raised.*Traceback.*boom from rank 1"):
        run_on_ranks(_raise_on_rank_1, 2, tp=1, timeout=120)


def test_hook_keywords_are_the_protocols_in_order() -> None:
    from mcore_hooks import OUTPUT_PROCESSOR_KEYWORDS
    from mcore_hooks.testing import hook_keywords

    kw = hook_keywords(torch.zeros(2, 1, 4), torch.nn.Linear(4, 8, bias=False))
    assert tuple(kw) == OUTPUT_PROCESSOR_KEYWORDS
    assert kw["config"].context_parallel_size == 1
    assert kw["compute_language_model_loss"].__self__.cp_group is None
