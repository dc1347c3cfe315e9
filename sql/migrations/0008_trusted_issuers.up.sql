-- Trusted JWT/OIDC issuers of an org (docs/jwt.md): the data plane
-- accepts their tokens as credentials, mapped to the org's teams and users
-- through claims. (issuer, audience) is unique across orgs so that a token
-- names one org.
CREATE TABLE trusted_issuers (
    id              text PRIMARY KEY,
    org_id          text NOT NULL REFERENCES orgs (id),
    issuer          text NOT NULL CHECK (length(issuer) BETWEEN 1 AND 2000),
    audience        text NOT NULL CHECK (length(audience) BETWEEN 1 AND 500),
    jwks_url        text NOT NULL DEFAULT '',
    team_claim      text NOT NULL DEFAULT '',
    user_claim      text NOT NULL DEFAULT '',
    customer_claim  text NOT NULL DEFAULT '',
    unknown_policy  text NOT NULL CHECK (unknown_policy IN ('refuse', 'default_team')),
    default_team_id text REFERENCES teams (id),
    created_at      timestamptz NOT NULL,
    UNIQUE (issuer, audience)
);
CREATE INDEX trusted_issuers_org_idx ON trusted_issuers (org_id);
