"""Sliding-window attention (Mistral 7B, gpt-oss): the attention core's FLOPs and the model-FLOPs convention count
each windowed layer's window, against closed forms."""

from __future__ import annotations

import pytest

from executor.parallel import LayoutError, check_supported
from plan import loader
from plan.model_math import model_flops_per_token, param_count
from plan.schema import ModelSpec
from twin.step.kernels import attention_flops

S, W = 4096, 128


def _oss(**fields: object) -> ModelSpec:
    spec = loader.expand_model({"model": "gpt-oss-120b"}, "gpt-oss-120b")["model"]
    return ModelSpec.model_validate({**spec, **fields})


def test_alternate_windowed_layers_compute_half_the_layers_over_their_window() -> None:
    m, full = _oss(), _oss(sliding_window=None, full_attention_every=None)
    windowed = (S * W - W * W / 2) / (S * S / 2)  # a query attends its 128 most recent keys, the first ones fewer
    assert m.windowed_share == 0.5
    assert m.causal_window_factor == pytest.approx(0.5 + 0.5 * windowed)
    assert attention_flops(m, 1, S, 1) == pytest.approx(attention_flops(full, 1, S, 1) * (0.5 + 0.5 * windowed))
    every = _oss(full_attention_every=None)  # every layer windowed
    assert attention_flops(every, 1, S, 1) == pytest.approx(attention_flops(full, 1, S, 1) * windowed)


def test_model_flops_count_a_windowed_query_against_its_window() -> None:
    m, full = _oss(), _oss(sliding_window=None, full_attention_every=None)
    unmasked = 12 * m.layers * m.heads * m.d_head * S  # the convention's whole-sequence term
    assert model_flops_per_token(full) - model_flops_per_token(m) == pytest.approx(unmasked * 0.5 * (1 - W / S))
    assert param_count(m) == param_count(full)  # a window changes no weight


def test_a_window_as_long_as_the_sequence_changes_nothing() -> None:
    m, full = _oss(sliding_window=S), _oss(sliding_window=None, full_attention_every=None)
    assert attention_flops(m, 1, S, 1) == attention_flops(full, 1, S, 1)


def test_full_attention_every_needs_a_window_and_the_executor_refuses_windows() -> None:
    with pytest.raises(ValueError, match="set sliding_window"):
        _oss(sliding_window=None)
    plan = loader.load("cpu-tiny", ["model.sliding_window=32"])
    with pytest.raises(LayoutError, match="drop sliding_window"):
        check_supported(plan)
