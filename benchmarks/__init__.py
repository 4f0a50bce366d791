"""lowbit's benchmarks: scripts run as modules (``python -m benchmarks.NAME``) from the repo root.

Running them as modules keeps this folder off ``sys.path``, so a script named like a
package (``benchmarks/peft.py``) never shadows that package, and every script shares
`benchmarks.common` instead of loading its siblings by file path.
"""
