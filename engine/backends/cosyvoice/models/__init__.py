"""The torch modules of CosyVoice 2/3 with upstream parameter names: Qwen2 body and speech LM,
flow (token encoders, U-Net and DiT estimators), HiFT vocoder, prompt mel and frontend features."""
