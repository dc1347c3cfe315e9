package store

import (
	"context"
	"fmt"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// TrustedIssuer is a JWT/OIDC issuer an org trusts on the data plane.
type TrustedIssuer struct {
	ID, OrgID, Issuer, Audience, JWKSURL string
	TeamClaim, UserClaim, CustomerClaim  string
	ProjectClaim, TagsClaim              string // "" for none
	UnknownPolicy                        string // "refuse" or "default_team"
	DefaultTeamID                        string // "" for none
	CreatedAt                            time.Time
}

func trustedIssuerFromRow(r dbsqlc.TrustedIssuer) TrustedIssuer {
	return TrustedIssuer{ID: r.ID, OrgID: r.OrgID, Issuer: r.Issuer, Audience: r.Audience, JWKSURL: r.JwksUrl,
		TeamClaim: r.TeamClaim, UserClaim: r.UserClaim, CustomerClaim: r.CustomerClaim,
		ProjectClaim: r.ProjectClaim, TagsClaim: r.TagsClaim,
		UnknownPolicy: r.UnknownPolicy, DefaultTeamID: derefStr(r.DefaultTeamID), CreatedAt: r.CreatedAt}
}

// TrustedIssuerGet returns issuer id if t may see it.
func (s *Store) TrustedIssuerGet(ctx context.Context, t Tenant, id string) (TrustedIssuer, error) {
	r, err := s.q.TrustedIssuerGet(ctx, s.pool, dbsqlc.TrustedIssuerGetParams{ID: id, OrgID: optStr(t.OrgID)})
	if err != nil {
		return TrustedIssuer{}, orNotFound(err, "trusted issuer "+id)
	}
	return trustedIssuerFromRow(r), nil
}

// TrustedIssuerList returns a page of the issuers visible to t, in id order.
func (s *Store) TrustedIssuerList(ctx context.Context, t Tenant, p Page) ([]TrustedIssuer, error) {
	rows, err := s.q.TrustedIssuerList(ctx, s.pool, dbsqlc.TrustedIssuerListParams{AfterID: p.After, OrgID: optStr(t.OrgID), Lim: int32(p.Limit)})
	if err != nil {
		return nil, fmt.Errorf("list trusted issuers: %w", err)
	}
	out := make([]TrustedIssuer, 0, len(rows))
	for _, r := range rows {
		out = append(out, trustedIssuerFromRow(r))
	}
	return out, nil
}

// TrustedIssuerInsert creates ti (ErrAlreadyExists when another issuer
// has the same issuer and audience); CreatedAt is the transaction time.
func (t *Tx) TrustedIssuerInsert(ctx context.Context, ti *TrustedIssuer) error {
	ti.CreatedAt = t.now
	return translate(t.q.TrustedIssuerInsert(ctx, t.tx, dbsqlc.TrustedIssuerInsertParams{
		ID: ti.ID, OrgID: ti.OrgID, Issuer: ti.Issuer, Audience: ti.Audience, JwksUrl: ti.JWKSURL,
		TeamClaim: ti.TeamClaim, UserClaim: ti.UserClaim, CustomerClaim: ti.CustomerClaim,
		UnknownPolicy: ti.UnknownPolicy, DefaultTeamID: optStr(ti.DefaultTeamID), CreatedAt: t.now,
		ProjectClaim: ti.ProjectClaim, TagsClaim: ti.TagsClaim,
	}))
}

// TrustedIssuerGetForUpdate locks issuer id if tn may see it.
func (t *Tx) TrustedIssuerGetForUpdate(ctx context.Context, tn Tenant, id string) (TrustedIssuer, error) {
	r, err := t.q.TrustedIssuerGetForUpdate(ctx, t.tx, dbsqlc.TrustedIssuerGetForUpdateParams{ID: id, OrgID: optStr(tn.OrgID)})
	if err != nil {
		return TrustedIssuer{}, orNotFound(err, "trusted issuer "+id)
	}
	return trustedIssuerFromRow(r), nil
}

// TrustedIssuerDelete deletes issuer id.
func (t *Tx) TrustedIssuerDelete(ctx context.Context, id string) error {
	return translate(t.q.TrustedIssuerDelete(ctx, t.tx, id))
}
