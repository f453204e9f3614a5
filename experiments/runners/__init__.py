"""Runners: one point of one framework built, checked against float64, timed and measured."""
