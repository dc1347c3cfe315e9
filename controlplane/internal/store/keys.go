package store

import (
	"context"
	"fmt"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// Key is a virtual key. Its token hash is never returned by the store's
// reads (only KeyAuthRecords exports hashes, for the data planes).
type Key struct {
	ID     string
	OrgID  string
	TeamID string // "" for an org-level key
	UserID string // "" without an owner user
	// Project and Alias are free-form labels.
	Project       string
	Alias         string
	DisplayPrefix string
	Last4         string
	ExpiresAt     *time.Time // nil: never expires
	Tags          []string
	// TrafficClass is the stored form of the key's traffic class; "" means
	// unspecified. The admin package owns the mapping to the API enum.
	TrafficClass      string
	ModelGroupAliases map[string]string
	EnforcedParams    []string
	AllowedRoutes     []string
	Limits            []byte // JSON of sluice.admin.v1.Limits
	// Blocked is changed only through KeySetBlocked.
	Blocked       bool
	Metadata      map[string]string
	RotationCount int64
	RotatedAt     *time.Time
	// Fallbacks are the key's per-group fallback overrides; they change
	// only through KeyFallbacksSet.
	Fallbacks Fallbacks
	CreatedAt time.Time
	UpdatedAt time.Time
}

// KeySecret is what the store keeps of a token: its keyed hash, the
// pepper version of the hash and the parts shown to humans.
type KeySecret struct {
	Hash          []byte
	PepperVersion int
	DisplayPrefix string
	Last4         string
}

// KeyQuery filters KeyList; empty fields mean "any".
type KeyQuery struct {
	TeamID      string
	UserID      string
	AliasPrefix string
	Blocked     *bool
	Tag         string
}

func keyFromRow(r dbsqlc.Key) (Key, error) {
	md, err := decodeMetadata(r.Metadata)
	if err != nil {
		return Key{}, err
	}
	aliases, err := decodeMetadata(r.ModelGroupAliases)
	if err != nil {
		return Key{}, fmt.Errorf("decode model group aliases of key %s: %w", r.ID, err)
	}
	fb, err := decodeFallbacks(r.Fallbacks)
	if err != nil {
		return Key{}, fmt.Errorf("decode fallbacks of key %s: %w", r.ID, err)
	}
	return Key{
		Fallbacks: fb,
		ID:        r.ID, OrgID: r.OrgID, TeamID: derefStr(r.TeamID), UserID: derefStr(r.UserID),
		Project: r.Project, Alias: r.Alias, DisplayPrefix: r.DisplayPrefix, Last4: r.Last4,
		ExpiresAt: r.ExpiresAt, Tags: r.Tags, TrafficClass: r.TrafficClass, ModelGroupAliases: aliases,
		EnforcedParams: r.EnforcedParams, AllowedRoutes: r.AllowedRoutes, Limits: r.Limits,
		Blocked: r.Blocked, Metadata: md, RotationCount: r.RotationCount, RotatedAt: r.RotatedAt,
		CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt,
	}, nil
}

// nonNil returns s, or an empty slice for nil: the array columns are NOT
// NULL and pgx encodes a nil slice as NULL.
func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// KeyGet returns key id if t may see it.
func (s *Store) KeyGet(ctx context.Context, t Tenant, id string) (Key, error) {
	r, err := s.q.KeyGet(ctx, s.pool, dbsqlc.KeyGetParams{ID: id, OrgID: optStr(t.OrgID), TeamID: optStr(t.TeamID)})
	if err != nil {
		return Key{}, orNotFound(err, "key "+id)
	}
	return keyFromRow(r)
}

// KeyList returns a page of keys visible to t, in id order.
func (s *Store) KeyList(ctx context.Context, t Tenant, q KeyQuery, p Page) ([]Key, error) {
	team := t.TeamID
	if team == "" {
		team = q.TeamID
	}
	rows, err := s.q.KeyList(ctx, s.pool, dbsqlc.KeyListParams{
		AfterID: p.After, OrgID: optStr(t.OrgID), TeamID: optStr(team), UserID: optStr(q.UserID),
		AliasPrefix: q.AliasPrefix, Blocked: q.Blocked, Tag: optStr(q.Tag), Lim: int32(p.Limit),
	})
	if err != nil {
		return nil, fmt.Errorf("list keys: %w", err)
	}
	out := make([]Key, 0, len(rows))
	for _, r := range rows {
		k, err := keyFromRow(r)
		if err != nil {
			return nil, err
		}
		out = append(out, k)
	}
	return out, nil
}

// KeyCheckRefs checks that org orgID exists, that teamID, when set,
// names a team of that org, and that userID, when set, names a user of
// that org and, for a team key (teamID set), a member of that team: a
// key draws on its owner's budget, so only the team's own members may
// own its keys. Missing org or team, and a missing user of an org key,
// are NotFound naming it; a team key's owner who is not a member of the
// team (whether or not it exists elsewhere) is FailedPrecondition.
func (t *Tx) KeyCheckRefs(ctx context.Context, orgID, teamID, userID string) error {
	r, err := t.q.KeyRefsExist(ctx, t.tx, dbsqlc.KeyRefsExistParams{OrgID: orgID, TeamID: optStr(teamID), UserID: optStr(userID)})
	if err != nil {
		return fmt.Errorf("check key references: %w", err)
	}
	switch {
	case !r.OrgOk:
		return notFound("org " + orgID)
	case !r.TeamOk:
		return notFound("team " + teamID)
	case !r.MemberOk:
		return &Error{Code: ErrFailedPrecondition, Msg: "user_id: user " + userID + " is not a member of team " + teamID +
			"; a team key's owner must be a member of its team (add the user with AddTeamMember first)"}
	case !r.UserOk:
		return notFound("user " + userID)
	}
	return nil
}

// KeyInsert creates k with the given secret; Blocked, RotationCount and
// the timestamps are set from the transaction.
func (t *Tx) KeyInsert(ctx context.Context, k *Key, sec KeySecret) error {
	md, err := encodeMetadata(k.Metadata)
	if err != nil {
		return err
	}
	k.DisplayPrefix, k.Last4 = sec.DisplayPrefix, sec.Last4
	k.Blocked, k.RotationCount, k.RotatedAt = false, 0, nil
	k.CreatedAt, k.UpdatedAt = t.now, t.now
	return translate(t.q.KeyInsert(ctx, t.tx, dbsqlc.KeyInsertParams{
		ID: k.ID, OrgID: k.OrgID, TeamID: optStr(k.TeamID), UserID: optStr(k.UserID),
		Project: k.Project, Alias: k.Alias, TokenHash: sec.Hash, PepperVersion: int32(sec.PepperVersion),
		DisplayPrefix: sec.DisplayPrefix, Last4: sec.Last4, ExpiresAt: k.ExpiresAt, Tags: nonNil(k.Tags),
		TrafficClass: k.TrafficClass, ModelGroupAliases: encodeMap(k.ModelGroupAliases),
		EnforcedParams: nonNil(k.EnforcedParams), AllowedRoutes: nonNil(k.AllowedRoutes),
		Limits: jsonOrEmpty(k.Limits), Metadata: md, CreatedAt: t.now,
	}))
}

// KeyGetForUpdate returns key id locked for the rest of the transaction,
// if tn may see it.
func (t *Tx) KeyGetForUpdate(ctx context.Context, tn Tenant, id string) (Key, error) {
	r, err := t.q.KeyGetForUpdate(ctx, t.tx, dbsqlc.KeyGetForUpdateParams{ID: id, OrgID: optStr(tn.OrgID), TeamID: optStr(tn.TeamID)})
	if err != nil {
		return Key{}, orNotFound(err, "key "+id)
	}
	return keyFromRow(r)
}

// KeyUpdate writes k's settings (everything but org, team, secret, block
// state and rotation fields).
func (t *Tx) KeyUpdate(ctx context.Context, k *Key) error {
	md, err := encodeMetadata(k.Metadata)
	if err != nil {
		return err
	}
	k.UpdatedAt = t.now
	return translate(t.q.KeyUpdate(ctx, t.tx, dbsqlc.KeyUpdateParams{
		ID: k.ID, UserID: optStr(k.UserID), Project: k.Project, Alias: k.Alias, ExpiresAt: k.ExpiresAt,
		Tags: nonNil(k.Tags), TrafficClass: k.TrafficClass, ModelGroupAliases: encodeMap(k.ModelGroupAliases),
		EnforcedParams: nonNil(k.EnforcedParams), AllowedRoutes: nonNil(k.AllowedRoutes),
		Limits: jsonOrEmpty(k.Limits), Metadata: md, UpdatedAt: t.now,
	}))
}

// KeySetBlocked sets k's block state.
func (t *Tx) KeySetBlocked(ctx context.Context, k *Key, blocked bool) error {
	k.Blocked, k.UpdatedAt = blocked, t.now
	return translate(t.q.KeySetBlocked(ctx, t.tx, dbsqlc.KeySetBlockedParams{ID: k.ID, Blocked: blocked, UpdatedAt: t.now}))
}

// KeyDelete deletes key id; its old hashes go with it (ON DELETE CASCADE).
func (t *Tx) KeyDelete(ctx context.Context, id string) error {
	return translate(t.q.KeyDelete(ctx, t.tx, id))
}

// KeyRotate gives k a new secret on the same row, so everything keyed by
// the key id (limits, budgets, spend windows) is kept. With graceUntil set
// the current hash stays valid until then (key_old_hashes); without it,
// the current hash and every earlier one still in grace stop working at
// once: a rotation without grace is what one does after a leak. Old
// hashes whose grace has ended are dropped either way. k must have been
// read with KeyGetForUpdate.
func (t *Tx) KeyRotate(ctx context.Context, k *Key, sec KeySecret, graceUntil *time.Time) error {
	if err := t.q.KeyOldHashesDelete(ctx, t.tx, dbsqlc.KeyOldHashesDeleteParams{
		KeyID: k.ID, DropAll: graceUntil == nil, Now: t.now,
	}); err != nil {
		return fmt.Errorf("drop old hashes of key %s: %w", k.ID, err)
	}
	if graceUntil != nil {
		if err := t.q.KeyOldHashKeepCurrent(ctx, t.tx, dbsqlc.KeyOldHashKeepCurrentParams{
			KeyID: k.ID, ValidUntil: *graceUntil, CreatedAt: t.now,
		}); err != nil {
			return translate(err)
		}
	}
	now := t.now
	if err := t.q.KeyRotate(ctx, t.tx, dbsqlc.KeyRotateParams{
		ID: k.ID, TokenHash: sec.Hash, PepperVersion: int32(sec.PepperVersion),
		DisplayPrefix: sec.DisplayPrefix, Last4: sec.Last4, RotatedAt: &now,
	}); err != nil {
		return translate(err)
	}
	k.DisplayPrefix, k.Last4 = sec.DisplayPrefix, sec.Last4
	k.RotationCount++
	k.RotatedAt, k.UpdatedAt = &now, now
	return nil
}
