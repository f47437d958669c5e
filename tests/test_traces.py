import numpy as np
import pytest

from jtopoep import traces


def test_esft_microbatches_keep_totals():
    samples = traces.load_esft("intent")
    assert samples.shape == (127, 26, 64)
    mats = traces.esft_microbatches(samples, num_ranks=8, layer=3, samples_per_rank=2)
    assert mats.shape == (127 // 16, 8, 64)
    np.testing.assert_array_equal(mats.sum(0).sum(0), samples[:16 * (127 // 16), 3].sum(0))
    # sample i of a micro-batch goes to rank i % 8
    np.testing.assert_array_equal(mats[0, 1], samples[1, 3] + samples[9, 3])


def test_esft_tiling_feeds_copies_different_samples():
    samples = traces.load_esft("translation")
    mats = traces.esft_microbatches(samples, num_ranks=8, layer=5, num_experts=128)
    assert mats.shape[2] == 128
    assert mats.sum() == 2 * samples[:8 * mats.shape[0], 5].sum()
    assert not np.array_equal(mats[0, :, :64], mats[0, :, 64:])


def test_olmoe_loader_and_microbatches():
    totals = traces.load_olmoe("olmoe", "github")
    assert totals.shape == (3, 64)
    mats = traces.olmoe_microbatches(totals[1], num_ranks=8, tokens_per_rank=100, top_k=8, steps=3, seed=1)
    assert mats.shape == (3, 8, 64) and (mats.sum(2) == 800).all()
    assert (mats <= 100).all()  # an expert takes at most one slot of each token
    again = traces.olmoe_microbatches(totals[1], num_ranks=8, tokens_per_rank=100, top_k=8, steps=3, seed=1)
    np.testing.assert_array_equal(mats, again)
    assert traces.load_olmoe("mistral", "arxiv").shape == (3, 8)


@pytest.mark.parametrize("bad,match", [(dict(model="gpt"), "unknown model 'gpt'"),
                                       (dict(domain="poetry"), "unknown domain 'poetry'"),
                                       (dict(kind="top3"), "unknown kind 'top3'")])
def test_olmoe_bad_names(bad, match):
    with pytest.raises(ValueError, match=match):
        traces.load_olmoe(**bad)


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace file .* is missing"):
        traces.load_esft("intent", tmp_path / "nope.npz")


def test_synthetic_generators_are_seeded():
    a = traces.zipf(8, 32, 64, 4, 1.2, steps=5, drift=2, seed=3)
    np.testing.assert_array_equal(a, traces.zipf(8, 32, 64, 4, 1.2, steps=5, drift=2, seed=3))
    assert a.shape == (5, 8, 32) and (a.sum(2) == 256).all() and (a <= 64).all()
    assert not np.array_equal(a[0].sum(0).argsort(), a[4].sum(0).argsort())  # the hot set drifts
    b = traces.bursts(8, 32, 64, 4, steps=4, share=0.9, every=2, seed=0)
    assert (b.sum(2) == 256).all() and b[0].sum(0).max() > 3 * b[1].sum(0).max() / 2


def test_scale_counts_keeps_shares():
    counts = np.array([[1, 2, 3, 0], [5, 0, 0, 5]])
    out = traces.scale_counts(counts, 100)
    np.testing.assert_array_equal(out.sum(1), [100, 100])
    np.testing.assert_array_equal(out[1], [50, 0, 0, 50])
    assert out[0].tolist() == [17, 33, 50, 0]


@pytest.mark.parametrize("task", traces.ESFT_TASKS)
def test_esft_tokens_agree_with_counts(task):
    """The shipped token-level routing and per-prompt counts describe the same routing."""
    expert_ids, sample_start = traces.load_esft_tokens(task)
    counts = traces.load_esft(task)
    assert expert_ids.shape[1:] == (26, 6) and len(sample_start) == len(counts) + 1
    prompt = np.repeat(np.arange(len(counts)), np.diff(sample_start))
    rebuilt = np.zeros_like(counts)
    np.add.at(rebuilt, (prompt[:, None, None], np.arange(26)[None, :, None], expert_ids), 1)
    np.testing.assert_array_equal(rebuilt, counts)


def test_shipped_traces_carry_licences():
    readme = (traces.DATA_DIR / "README.md").read_text()
    for origin, licence in (("deepseek-ai/ESFT", "LICENSE-ESFT"), ("allenai/OLMoE", "LICENSE-OLMoE")):
        assert origin in readme and (traces.DATA_DIR / licence).is_file()
