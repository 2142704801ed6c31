"""Token to wave: streaming flow + vocoder chunks for many streams (streams.py), the per-stream
vocoder state (vocoder.py), and speed by mel stretching (mel_stretch.py)."""
