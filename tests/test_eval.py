import math

import pytest
import torch

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
