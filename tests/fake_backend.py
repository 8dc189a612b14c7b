"""An engine backend registered from outside the library, as a third party's would be
(``register_backend``): the stand-in engine under the name ``fake``, stepping in 4 ms so a
relay emits eager tokens while the WAN copy is still crossing."""

import dataclasses

from shared.engine.backend import register_backend
from shared.engine.standin import StandinEngine

STEP_S = 0.004

register_backend("fake")(
    lambda options, loaded=None: StandinEngine(dataclasses.replace(options, standin_step_s=STEP_S))
)
