// Package authn authenticates virtual keys on the data plane's request
// path, from memory only: no database and no network (SPEC §4, §7 step 1).
//
// This package holds the Principal, the typed outcomes of key
// authentication and the Authenticator interface the gateway and
// /v1/auth/check call (VirtualKeys, JWT, and Credentials choosing between them). The lookup itself is
// catalog.Authenticate, over the immutable catalog built from a config
// snapshot: a presented token is first checked for shape and checksum (a
// typo or a scanner hit never reaches the lookup), then hashed under every
// configured pepper version and looked up. Tokens that were rotated out
// stay valid until their grace deadline. authn does not import the
// catalog (the catalog returns its errors and Principal); the catalog is
// reached through the Directory interface.
package authn

import (
	"errors"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// Principal is an authenticated key with its chain.
type Principal struct {
	Key  *configv1.Key
	Org  *configv1.Org
	Team *configv1.Team // nil for org-level keys
	User *configv1.User // nil without an owner user
	// Member is the owner user's membership of the key's team, if any.
	Member *configv1.Member
	// Subject is the "sub" of a JWT ("" for keys); Customer is the end
	// customer its customer claim names ("" for none).
	Subject, Customer string
}

// Identity is what a verified JWT's claims name (claim mappings of its
// trusted issuer): team (name or id), user (e-mail or id), end customer.
type Identity struct {
	Subject, Team, User, Customer string
	// Project and Tags are mapped by the issuer's project_claim and
	// tags_claim (checked by internal/labels), as a key's project and tags.
	Project string
	Tags    []string
}

// Errors of Authenticate. ErrMalformed, ErrUnknown and ErrExpired are
// authentication failures (401); a *BlockedError is a refusal (403).
var (
	ErrMalformed = errors.New("key is malformed or mistyped")
	ErrUnknown   = errors.New("key is unknown or has been deleted")
	ErrExpired   = errors.New("key has expired")
	// ErrUnknownTeam and ErrUnknownUser: a JWT names a team or user its
	// org does not have, under the refuse policy.
	ErrUnknownTeam = errors.New("token names no team of the org")
	ErrUnknownUser = errors.New("token names no user of the org")
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
