ALTER TABLE spend_logs DROP COLUMN cache_creation_tokens;
