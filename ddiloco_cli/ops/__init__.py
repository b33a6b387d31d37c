"""Operator tools: status and inspect, verify, metrics, evaluation, export, init, demo."""
