"""Public reward/extractor API of the built-in tasks, as ``espert eval`` and users call it."""

from espert.tasks import reward_task
from espert.tasks.rewards import gsm8k_extract


def test_gsm8k_task_extract_keeps_the_last_number_fallback():
    # Task.extract passes the reference answer as a second positional argument to extractors that take
    # two; gsm8k_extract's fallback flag is keyword-only so that answer (or None) cannot switch it off.
    task = reward_task("gsm8k")
    text = "so the answer is 0.5"
    assert task.score([text], ["#### 1/2"]) == [1.0]
    assert task.extract(text) == "0.5"
    assert task.extract(text, "#### 1/2") == "0.5"
    assert reward_task("gsm8k_strict").extract(text) is None
    assert gsm8k_extract(text, fallback_last_number=False) is None
