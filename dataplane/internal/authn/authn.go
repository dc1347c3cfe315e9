// Package authn authenticates virtual keys on the data plane's request
// path, from memory only: no database and no network (SPEC §4, §7 step 1).
//
// An Index is built once from the key records of a config snapshot and is
// immutable afterwards, so requests may share it without locks. It maps
// token hashes to records; a presented token is first checked for shape
// and checksum (a typo or a scanner hit never reaches the lookup), then
// hashed under every configured pepper version and looked up. Tokens that
// were rotated out stay valid until their grace deadline.
package authn

import (
	"errors"
	"fmt"
	"time"

	"github.com/sluicegw/sluice/internal/token"
)

// Errors of Authenticate. ErrMalformed, ErrUnknown and ErrExpired are
// authentication failures (401); a *BlockedError is a refusal (403).
var (
	ErrMalformed = errors.New("key is malformed or mistyped")
	ErrUnknown   = errors.New("key is unknown or has been deleted")
	ErrExpired   = errors.New("key has expired")
)

// Blocked scopes, widest first.
const (
	ScopeOrg  = "org"
	ScopeTeam = "team"
	ScopeUser = "user"
	ScopeKey  = "key"
)

// BlockedError says that a key, or a level above it, is blocked.
type BlockedError struct {
	// Scope is the blocked level: ScopeKey, ScopeUser, ScopeTeam or ScopeOrg.
	Scope string
}

func (e *BlockedError) Error() string {
	if e.Scope == ScopeKey {
		return "key is blocked"
	}
	return "key's " + e.Scope + " is blocked"
}

// Record is one virtual key as the data plane knows it.
type Record struct {
	KeyID  string
	OrgID  string
	TeamID string // "" for an org-level key
	UserID string // "" without an owner user
	// Hash is HMAC-SHA256 of the current token under pepper PepperVersion.
	Hash          []byte
	PepperVersion int
	// ExpiresAt is when the key stops working; zero means never.
	ExpiresAt time.Time
	// BlockedScope names the blocked level of the chain key → user → team
	// → org (one of the Scope constants), or "" when none is blocked.
	BlockedScope string
	// OldHashes are rotated-out tokens still honoured until their
	// deadline.
	OldHashes []OldHash
}

// OldHash is the hash of a rotated-out token, accepted while the time is
// before ValidUntil.
type OldHash struct {
	Hash          []byte
	PepperVersion int
	ValidUntil    time.Time
}

// entry is one hash of the index.
type entry struct {
	rec           *Record
	hash          []byte
	pepperVersion int
	validUntil    time.Time // zero for the current hash
}

// Index finds keys by token hash. It is immutable once built.
type Index struct {
	byHash map[string]entry
}

// NewIndex builds an index over records. The records are copied by
// pointer and must not be changed afterwards. Hashes are unique in the
// control plane; should a current hash and an old hash ever collide, the
// current one wins.
func NewIndex(records []Record) *Index {
	idx := &Index{byHash: make(map[string]entry, len(records))}
	for i := range records {
		r := &records[i]
		for _, o := range r.OldHashes {
			if _, dup := idx.byHash[string(o.Hash)]; !dup {
				idx.byHash[string(o.Hash)] = entry{rec: r, hash: o.Hash, pepperVersion: o.PepperVersion, validUntil: o.ValidUntil}
			}
		}
	}
	for i := range records {
		r := &records[i]
		idx.byHash[string(r.Hash)] = entry{rec: r, hash: r.Hash, pepperVersion: r.PepperVersion}
	}
	return idx
}

// Len returns the number of hashes (current and old) in the index.
func (x *Index) Len() int { return len(x.byHash) }

// Authenticate returns the record of tok at time now. The token's shape
// and checksum are checked before any lookup (ErrMalformed); then its
// hash under every pepper version in peppers is looked up (ErrUnknown when
// none matches, or when it matches a rotated-out token whose grace has
// ended). A known key past its expiry gives ErrExpired, a blocked one a
// *BlockedError; with these two errors the record is returned as well, so
// that the caller can attribute the refusal to the key.
func (x *Index) Authenticate(peppers *token.Peppers, tok string, now time.Time) (*Record, error) {
	if err := token.Check(token.KeyPrefix, tok); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	for _, c := range peppers.Candidates(tok) {
		e, ok := x.byHash[string(c.Hash)]
		// The map lookup is by hash; the constant-time comparison confirms
		// it (SPEC §4) and the version check makes sure the stored hash was
		// made under the pepper this candidate was hashed with.
		if !ok || e.pepperVersion != c.Version || !token.Equal(e.hash, c.Hash) {
			continue
		}
		if !e.validUntil.IsZero() && !now.Before(e.validUntil) {
			return nil, ErrUnknown // a rotated-out token after its grace
		}
		r := e.rec
		if !r.ExpiresAt.IsZero() && !now.Before(r.ExpiresAt) {
			return r, ErrExpired
		}
		if r.BlockedScope != "" {
			return r, &BlockedError{Scope: r.BlockedScope}
		}
		return r, nil
	}
	return nil, ErrUnknown
}
