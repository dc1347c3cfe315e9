ALTER TABLE alert_webhooks
    DROP COLUMN IF EXISTS previous_secret_ciphertext,
    DROP COLUMN IF EXISTS previous_valid_until,
    DROP COLUMN IF EXISTS secret_rotated_at;
