DROP TABLE trusted_issuers;
