"""The environment executor: multi-turn episodes (tools, feedback, games) between the policy's turns."""
