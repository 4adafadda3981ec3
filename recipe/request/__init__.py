"""API requests → ConvertedRequest: one module per API (chat, responses, messages) and their shared checks."""
