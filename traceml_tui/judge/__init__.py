"""Judgement: the run's state in bounded windows and the pure rules over it (diagnosis,
cost, hang, setup checks, bandwidth). No I/O, no clocks."""
