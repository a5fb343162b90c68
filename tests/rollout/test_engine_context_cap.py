"""A prompt past the model's own context length: the error must not suggest a useless fix."""

import pytest

from handoff.errors import HandoffError
from handoff.rollout.engine import Engine
from handoff.rollout.sampling import SamplingParams


def test_prompt_past_max_position_embeddings_names_the_model_limit(qwen3_dir, ref):
    engine = Engine(str(qwen3_dir), ref.cfg(max_model_len=1 << 20, num_blocks=256))
    cap = engine.max_model_len
    assert cap < 1 << 20, "the model's context did not cap max_model_len: nothing to test"
    with pytest.raises(HandoffError) as err:
        engine.generate([[1] * cap], SamplingParams(temperature=0.0, max_tokens=1))
    assert "max_position_embeddings" in str(err.value)
    assert "raise rollout.max_model_len" not in str(err.value)
