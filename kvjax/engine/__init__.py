"""The jitted step function, its inputs, sampling and the engine loop.

``Engine`` (continuous batching over a model's ``forward_step``), ``StepInputs`` (the device-side step
inputs built from the scheduler's ``StepPlan``).
"""

from kvjax.engine.engine import Engine
from kvjax.engine.inputs import StepInputs
