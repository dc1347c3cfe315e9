DROP TABLE alert_deliveries;
DROP TABLE alert_webhooks;
DROP INDEX admin_tokens_previous_hash_idx;
ALTER TABLE admin_tokens
    DROP COLUMN previous_hash,
    DROP COLUMN previous_pepper_version,
    DROP COLUMN previous_valid_until,
    DROP COLUMN rotated_at;
DROP TABLE model_group_grants;
ALTER TABLE model_groups DROP COLUMN platform_wide;
