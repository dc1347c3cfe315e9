-- 0016_issuer_labels: a trusted issuer may map claims to the project and
-- tags of its tokens' requests (docs/jwt.md), which project and tag scopes
-- limit like a key's (docs/tenancy.md). '' maps nothing.
ALTER TABLE trusted_issuers
    ADD COLUMN project_claim text NOT NULL DEFAULT '' CHECK (length(project_claim) <= 200),
    ADD COLUMN tags_claim    text NOT NULL DEFAULT '' CHECK (length(tags_claim) <= 200);
