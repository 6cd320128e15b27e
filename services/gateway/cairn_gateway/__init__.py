"""cairn's LLM gateway: one wire protocol (OpenAI chat-completions) to many model
vendors, with tiers, failover that never does harm, run budgets and ceilings."""
