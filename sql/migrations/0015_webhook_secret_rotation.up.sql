-- Alert webhook secret rotation with grace (docs/alerts.md, "Rotating the
-- secret"): the previous secret, sealed like the current one, signs every
-- request besides it until previous_valid_until.
ALTER TABLE alert_webhooks
    ADD COLUMN previous_secret_ciphertext bytea,
    ADD COLUMN previous_valid_until timestamptz,
    ADD COLUMN secret_rotated_at timestamptz;
