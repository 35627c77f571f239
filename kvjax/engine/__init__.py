"""The jitted step function, its inputs, sampling and the engine loop.

``Engine`` (continuous batching over a model's ``forward_step``, overlapping the host's planning of the next
step with the device's current one), ``SamplingParams`` (a request's temperature, top-k / top-p, seed, length and
stop ids), ``StepInputs`` (the device-side step inputs built from the scheduler's ``StepPlan``); ``sizing``
sizes a cache from the model and a memory budget, ``metrics`` records each step.
"""

from kvjax.engine.outputs import StepOutput, TokenEvent
from kvjax.engine.engine import Engine
from kvjax.engine.sampling import SamplingParams
from kvjax.inputs import StepInputs

__all__ = ["Engine", "SamplingParams", "StepInputs", "StepOutput", "TokenEvent"]
