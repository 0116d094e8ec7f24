"""Who may call pdserve and how much: API keys and tenants, their quotas, cache salts, transport credentials."""
