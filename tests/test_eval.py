import math

import pytest
import torch
from conftest import skip_without_bundled

from lowbit.errors import DataError
from lowbit.eval import eval_windows, perplexity


def brute_force_ppl(model, windows):
    total, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logp = torch.log_softmax(model(w[None]).logits[0].double(), -1)
            for t in range(1, len(w)):
                total -= float(logp[t - 1, w[t]])
                n += 1
    return math.exp(total / n), n


def test_perplexity_equals_token_by_token_reference(tiny_llama):
    model, _ = tiny_llama
    tokens = torch.randint(0, 500, (1, 200), generator=torch.Generator().manual_seed(0))
    r = perplexity(model, tokens, seqlen=48, windows=3, batch_size=2, progress=False)
    ref, n = brute_force_ppl(model, eval_windows(tokens, 48, 3))
    assert r.tokens == n == 3 * 47 and r.windows == 3
    assert r.ppl == pytest.approx(ref, rel=1e-5)


def test_whole_text_option_and_too_long_seqlen(tiny_llama):
    model, _ = tiny_llama
    tokens = torch.arange(100).reshape(1, -1) % 500
    assert eval_windows(tokens, 30, 0).shape == (3, 30)
    with pytest.raises(DataError, match="fewer than one window"):
        perplexity(model, tokens, seqlen=512, progress=False)


def test_batch_size_does_not_change_the_result(tiny_llama):
    model, _ = tiny_llama
    tokens = torch.randint(0, 500, (1, 160), generator=torch.Generator().manual_seed(1))
    one = perplexity(model, tokens, seqlen=32, windows=None, batch_size=1, progress=False)
    many = perplexity(model, tokens, seqlen=32, windows=None, batch_size=3, progress=False)
    assert one.windows == many.windows == 5 and one.tokens == 5 * 31
    assert one.nll == pytest.approx(many.nll, rel=1e-5)
    d = one.to_dict()
    assert set(d) == {"ppl", "nll", "tokens", "windows", "seconds"} and d["ppl"] == pytest.approx(math.exp(d["nll"]))


def test_zero_shot_without_lm_eval_says_how_to_install(monkeypatch, tiny_llama):
    import sys

    from lowbit.errors import LowbitError
    from lowbit.eval import zero_shot

    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(LowbitError, match=r"pip install 'lowbit\[eval\]'"):
        zero_shot(*tiny_llama, tasks=["arc_easy"])


@pytest.mark.slow
def test_bundled_model_perplexity_is_sane():
    skip_without_bundled()
    from lowbit.data import eval_tokens
    from lowbit.models import load_model

    lm = load_model()
    r = perplexity(lm.model, eval_tokens(lm.tokenizer), seqlen=512, windows=4, progress=False)
    assert r.windows == 4 and r.tokens == 4 * 511
    assert 5 < r.ppl < 40  # SmolLM2-135M on Python's docs is about 15 at seqlen 512
