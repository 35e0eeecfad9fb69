"""Moved to kafilad/step_timeline.py (shared by node/ and control/, which must not import node/);
re-exported here for the importers not yet changed (kafilad/node/ring.py, scripts/bench_ring.py)."""

from kafilad.step_timeline import TIMELINE, TIMELINE_ENV, StepTimeline, read_timeline  # noqa: F401
