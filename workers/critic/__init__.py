"""The critic executor: a value model for GAE advantages, trained on devices of its own (spec.roles.critic)."""
