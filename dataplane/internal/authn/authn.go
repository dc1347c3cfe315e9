// Package authn authenticates virtual keys on the data plane's request
// path, from memory only: no database and no network (SPEC §4, §7 step 1).
//
// This package holds the typed outcomes of key authentication; the lookup
// itself is catalog.Authenticate, over the immutable catalog built from a
// config snapshot: a presented token is first checked for shape and
// checksum (a typo or a scanner hit never reaches the lookup), then hashed
// under every configured pepper version and looked up. Tokens that were
// rotated out stay valid until their grace deadline.
package authn

import "errors"

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
