"""RL objectives over tree targets (PPO/GRPO variants, KL), equal to their expanded forms."""
