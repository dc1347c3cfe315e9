package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// AdminToken is a stored admin token (its hash is never returned).
type AdminToken struct {
	ID            string
	Name          string
	Scope         authz.Scope
	OrgID         string
	TeamID        string
	Role          authz.Role
	DisplayPrefix string
	Last4         string
	ExpiresAt     *time.Time
	RevokedAt     *time.Time
	CreatedBy     string
	CreatedAt     time.Time
	// PreviousValidUntil is set after a rotation with grace: until then
	// the previous secret authenticates too (ViaPrevious says a lookup
	// matched it).
	PreviousValidUntil *time.Time
	RotatedAt          *time.Time
	ViaPrevious        bool
}

// NewAdminToken is what AdminTokenInsert needs: the token's public fields
// and its hash.
type NewAdminToken struct {
	AdminToken
	Hash          []byte
	PepperVersion int
}

func adminTokenFromRow(r dbsqlc.AdminToken) (AdminToken, error) {
	scope, err := authz.ParseScope(r.Scope)
	if err != nil {
		return AdminToken{}, err
	}
	role, err := authz.ParseRole(r.Role)
	if err != nil {
		return AdminToken{}, err
	}
	return AdminToken{
		ID: r.ID, Name: r.Name, Scope: scope, OrgID: derefStr(r.OrgID), TeamID: derefStr(r.TeamID), Role: role,
		DisplayPrefix: r.DisplayPrefix, Last4: r.Last4, ExpiresAt: r.ExpiresAt, RevokedAt: r.RevokedAt,
		CreatedBy: r.CreatedBy, CreatedAt: r.CreatedAt, PreviousValidUntil: r.PreviousValidUntil, RotatedAt: r.RotatedAt,
	}, nil
}

// AdminTokenByHash returns the token with the given hash.
func (s *Store) AdminTokenByHash(ctx context.Context, hash []byte) (AdminToken, error) {
	r, err := s.q.AdminTokenGetByHash(ctx, s.pool, hash)
	if err != nil {
		return AdminToken{}, orNotFound(err, "admin token")
	}
	return adminTokenFromRow(r)
}

// MaxAdminTokenChain bounds how many issuers AdminTokenChainByHash walks.
const MaxAdminTokenChain = 64

// AdminTokenChainByHash returns the token with the given hash followed by
// the token that created it, and so on up its issuers, nearest first
// (at most MaxAdminTokenChain+1). The chain is complete when the last
// token's CreatedBy is authz.BootstrapID (the root, not a row); otherwise
// an issuer is missing or the chain is longer than the bound. ErrNotFound
// if no token has the hash.
func (s *Store) AdminTokenChainByHash(ctx context.Context, hash []byte) ([]AdminToken, error) {
	rows, err := s.q.AdminTokenChainByHash(ctx, s.pool, hash)
	if err != nil {
		return nil, fmt.Errorf("read admin token chain: %w", err)
	}
	if len(rows) == 0 {
		return nil, notFound("admin token")
	}
	out := make([]AdminToken, 0, len(rows))
	for _, r := range rows {
		a, err := adminTokenFromRow(dbsqlc.AdminToken{
			ID: r.ID, Name: r.Name, Scope: r.Scope, OrgID: r.OrgID, TeamID: r.TeamID, Role: r.Role,
			DisplayPrefix: r.DisplayPrefix, Last4: r.Last4, ExpiresAt: r.ExpiresAt, RevokedAt: r.RevokedAt,
			CreatedBy: r.CreatedBy, CreatedAt: r.CreatedAt, PreviousValidUntil: r.PreviousValidUntil,
		})
		if err != nil {
			return nil, err
		}
		a.ViaPrevious = r.ViaPrevious
		out = append(out, a)
	}
	return out, nil
}

// AdminTokenList returns a page of tokens visible to t.
func (s *Store) AdminTokenList(ctx context.Context, t Tenant, includeRevoked bool, p Page) ([]AdminToken, error) {
	rows, err := s.q.AdminTokenList(ctx, s.pool, dbsqlc.AdminTokenListParams{
		AfterID: p.After, OrgID: optStr(t.OrgID), TeamID: optStr(t.TeamID), IncludeRevoked: includeRevoked, Lim: int32(p.Limit),
	})
	if err != nil {
		return nil, fmt.Errorf("list admin tokens: %w", err)
	}
	out := make([]AdminToken, 0, len(rows))
	for _, r := range rows {
		a, err := adminTokenFromRow(r)
		if err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	return out, nil
}

// AdminTokenInsert stores a new token.
func (t *Tx) AdminTokenInsert(ctx context.Context, a *NewAdminToken) error {
	a.CreatedAt = t.now
	return translate(t.q.AdminTokenInsert(ctx, t.tx, dbsqlc.AdminTokenInsertParams{
		ID: a.ID, Name: a.Name, TokenHash: a.Hash, PepperVersion: int32(a.PepperVersion),
		DisplayPrefix: a.DisplayPrefix, Last4: a.Last4, Scope: a.Scope.String(), OrgID: optStr(a.OrgID),
		TeamID: optStr(a.TeamID), Role: a.Role.String(), ExpiresAt: a.ExpiresAt, CreatedBy: a.CreatedBy, CreatedAt: t.now,
	}))
}

// AdminTokenGetForUpdate returns token id, locked, if tn may see it.
func (t *Tx) AdminTokenGetForUpdate(ctx context.Context, tn Tenant, id string) (AdminToken, error) {
	r, err := t.q.AdminTokenGetForUpdate(ctx, t.tx, dbsqlc.AdminTokenGetForUpdateParams{ID: id, OrgID: optStr(tn.OrgID), TeamID: optStr(tn.TeamID)})
	if err != nil {
		return AdminToken{}, orNotFound(err, "admin token "+id)
	}
	return adminTokenFromRow(r)
}

// AdminTokenRevoke revokes a (not yet revoked) token.
func (t *Tx) AdminTokenRevoke(ctx context.Context, a *AdminToken) error {
	now := t.now
	a.RevokedAt = &now
	return translate(t.q.AdminTokenRevoke(ctx, t.tx, dbsqlc.AdminTokenRevokeParams{ID: a.ID, RevokedAt: &now}))
}

// AdminTokenDelete deletes token id.
func (t *Tx) AdminTokenDelete(ctx context.Context, id string) error {
	return translate(t.q.AdminTokenDelete(ctx, t.tx, id))
}

// AdminTokenRotate gives a its new secret (hash, pepper version, display
// prefix and last4 already set on a by the caller). With previousUntil
// the old hash keeps authenticating until then; without, it is dropped.
func (t *Tx) AdminTokenRotate(ctx context.Context, a *AdminToken, newHash []byte, newPepper int, oldHash []byte, oldPepper int, previousUntil *time.Time) error {
	now := t.now
	a.RotatedAt = &now
	a.PreviousValidUntil = previousUntil
	p := dbsqlc.AdminTokenRotateParams{ID: a.ID, TokenHash: newHash, PepperVersion: int32(newPepper),
		DisplayPrefix: a.DisplayPrefix, Last4: a.Last4, RotatedAt: &now}
	if previousUntil != nil {
		p.PreviousHash, p.PreviousValidUntil = oldHash, previousUntil
		p.PreviousPepperVersion = pgtype.Int4{Int32: int32(oldPepper), Valid: true}
	}
	return translate(t.q.AdminTokenRotate(ctx, t.tx, p))
}

// AdminTokenHash returns the current hash and pepper version of token id
// (for a rotation that keeps it as the previous secret).
func (t *Tx) AdminTokenHash(ctx context.Context, id string) ([]byte, int, error) {
	r, err := t.q.AdminTokenGetHash(ctx, t.tx, id)
	if err != nil {
		return nil, 0, orNotFound(err, "admin token "+id)
	}
	return r.TokenHash, int(r.PepperVersion), nil
}

// AdminTokenSetExpiry sets (nil: clears) token a's expiry.
func (t *Tx) AdminTokenSetExpiry(ctx context.Context, a *AdminToken, expires *time.Time) error {
	a.ExpiresAt = expires
	return translate(t.q.AdminTokenSetExpiry(ctx, t.tx, dbsqlc.AdminTokenSetExpiryParams{ID: a.ID, ExpiresAt: expires}))
}
