"""The auxiliary peer (`trahiv aux`): a CPU-only swarm member that gathers the trainers' metrics into a store, logs
them to experiment trackers, and (with other parts) saves checkpoints and serves a dashboard."""
