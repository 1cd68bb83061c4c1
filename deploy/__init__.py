"""Deployment tooling: the offline image build, the compose project driver and its smoke test."""
