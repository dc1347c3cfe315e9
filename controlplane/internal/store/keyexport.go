package store

import (
	"context"
	"fmt"
	"time"
)

// Blocked scopes of a key, widest first: the scope reported when several
// are blocked is the widest, since unblocking anything narrower would not
// let the key through.
const (
	BlockedScopeOrg  = "org"
	BlockedScopeTeam = "team"
	BlockedScopeUser = "user"
	BlockedScopeKey  = "key"
)

// KeyAuthRecord is what a data plane needs to authenticate one key:
// hashes only, never a token.
type KeyAuthRecord struct {
	KeyID         string
	OrgID         string
	TeamID        string // "" for an org-level key
	UserID        string // "" without an owner user
	Hash          []byte // HMAC-SHA256 of the current token
	PepperVersion int
	ExpiresAt     *time.Time // nil: never
	// BlockedScope names the widest blocked level of the chain key → user
	// → team → org (one of the BlockedScope constants), or "" when none is.
	BlockedScope string
	// OldHashes are the hashes of rotated-out tokens with their grace
	// deadlines, earliest first. Deadlines may already have passed: the
	// reader compares them with its own clock.
	OldHashes []KeyOldHash
}

// KeyOldHash is the hash of a rotated-out token, valid before ValidUntil.
type KeyOldHash struct {
	Hash          []byte
	PepperVersion int
	ValidUntil    time.Time
}

// KeyAuthRecords returns every key with its hashes, expiry and resolved
// block state, in key id order, read in one consistent snapshot of the
// database.
func (s *Store) KeyAuthRecords(ctx context.Context) ([]KeyAuthRecord, error) {
	tx, err := s.pool.BeginTx(ctx, pgxRepeatableReadRO)
	if err != nil {
		return nil, fmt.Errorf("begin key export: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	rows, err := s.q.KeyAuthList(ctx, tx)
	if err != nil {
		return nil, fmt.Errorf("list key hashes: %w", err)
	}
	old, err := s.q.KeyOldHashList(ctx, tx)
	if err != nil {
		return nil, fmt.Errorf("list old key hashes: %w", err)
	}
	out := make([]KeyAuthRecord, len(rows))
	byID := make(map[string]*KeyAuthRecord, len(rows))
	for i, r := range rows {
		scope := ""
		switch {
		case r.OrgBlocked:
			scope = BlockedScopeOrg
		case r.TeamBlocked:
			scope = BlockedScopeTeam
		case r.UserBlocked:
			scope = BlockedScopeUser
		case r.KeyBlocked:
			scope = BlockedScopeKey
		}
		out[i] = KeyAuthRecord{
			KeyID: r.ID, OrgID: r.OrgID, TeamID: derefStr(r.TeamID), UserID: derefStr(r.UserID),
			Hash: r.TokenHash, PepperVersion: int(r.PepperVersion), ExpiresAt: r.ExpiresAt, BlockedScope: scope,
		}
		byID[r.ID] = &out[i]
	}
	for _, o := range old {
		if rec := byID[o.KeyID]; rec != nil {
			rec.OldHashes = append(rec.OldHashes, KeyOldHash{Hash: o.TokenHash, PepperVersion: int(o.PepperVersion), ValidUntil: o.ValidUntil})
		}
	}
	return out, tx.Commit(ctx)
}
