ALTER TABLE trusted_issuers DROP COLUMN project_claim, DROP COLUMN tags_claim;
