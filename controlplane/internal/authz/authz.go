// Package authz decides what an admin principal may do (SPEC §5).
//
// A principal is the bootstrap token or an admin token: a scope (platform,
// one org, one team) and a role (viewer, editor, admin). Every admin RPC
// names a verb and a target and calls Check. The admin server's
// interceptor refuses any successful answer from a handler that never
// called Check, so an RPC added without authorisation fails loudly.
package authz

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
)

// Scope is how far a principal reaches.
type Scope int

// Scopes.
const (
	ScopePlatform Scope = iota + 1
	ScopeOrg
	ScopeTeam
)

func (s Scope) String() string {
	switch s {
	case ScopePlatform:
		return "platform"
	case ScopeOrg:
		return "org"
	case ScopeTeam:
		return "team"
	}
	return "unknown"
}

// ParseScope parses the stored form of a scope.
func ParseScope(s string) (Scope, error) {
	switch s {
	case "platform":
		return ScopePlatform, nil
	case "org":
		return ScopeOrg, nil
	case "team":
		return ScopeTeam, nil
	}
	return 0, fmt.Errorf("unknown scope %q", s)
}

// Role is what a principal may do inside its scope.
type Role int

// Roles, weakest first.
const (
	RoleViewer Role = iota + 1
	RoleEditor
	RoleAdmin
)

func (r Role) String() string {
	switch r {
	case RoleViewer:
		return "viewer"
	case RoleEditor:
		return "editor"
	case RoleAdmin:
		return "admin"
	}
	return "unknown"
}

// ParseRole parses the stored form of a role.
func ParseRole(s string) (Role, error) {
	switch s {
	case "viewer":
		return RoleViewer, nil
	case "editor":
		return RoleEditor, nil
	case "admin":
		return RoleAdmin, nil
	}
	return 0, fmt.Errorf("unknown role %q", s)
}

// BootstrapID is the principal id of the bootstrap token.
const BootstrapID = "bootstrap"

// Principal is an authenticated admin caller.
type Principal struct {
	// ID is BootstrapID or the admin token id; it is the audit actor.
	ID      string
	Name    string
	Scope   Scope
	OrgID   string // ScopeOrg and ScopeTeam
	TeamID  string // ScopeTeam
	Role    Role
	Expires time.Time // zero: never
}

// Verb is the kind of access an RPC needs.
type Verb int

// Verbs.
const (
	Read Verb = iota + 1
	Write
	ManageTokens
)

func (v Verb) minRole() Role {
	switch v {
	case Read:
		return RoleViewer
	case Write:
		return RoleEditor
	}
	return RoleAdmin
}

func (v Verb) String() string {
	switch v {
	case Read:
		return "read"
	case Write:
		return "change"
	}
	return "manage admin tokens for"
}

// Target is what an RPC touches.
type Target struct {
	// Platform marks targets only platform principals may touch (creating
	// or deleting orgs, blocking orgs).
	Platform bool
	OrgID    string
	// TeamID is set for team-level objects (a team, its members, its
	// keys). Team principals may only touch targets with their TeamID.
	TeamID string
	// What names the target in error messages ("team team_...").
	What string
}

// PlatformTarget is a target only platform principals may touch.
func PlatformTarget(what string) Target { return Target{Platform: true, What: what} }

// OrgTarget is an org-level object of org orgID.
func OrgTarget(orgID, what string) Target { return Target{OrgID: orgID, What: what} }

// TeamTarget is a team-level object of team teamID in org orgID. An empty
// teamID makes it an org-level target.
func TeamTarget(orgID, teamID, what string) Target {
	return Target{OrgID: orgID, TeamID: teamID, What: what}
}

// ErrDenied is wrapped by every refusal of Check.
var ErrDenied = errors.New("permission denied")

// Check reports whether p may apply verb to t. The error wraps ErrDenied
// and says why, without naming anything p may not see.
func Check(ctx context.Context, p *Principal, verb Verb, t Target) error {
	markChecked(ctx)
	if p == nil {
		return fmt.Errorf("no principal: %w", ErrDenied)
	}
	if p.Role < verb.minRole() {
		return fmt.Errorf("role %s may not %s %s: %w", p.Role, verb, t.What, ErrDenied)
	}
	switch p.Scope {
	case ScopePlatform:
		return nil
	case ScopeOrg:
		if t.Platform {
			return fmt.Errorf("%s needs a platform-scoped token: %w", t.What, ErrDenied)
		}
		if t.OrgID != p.OrgID {
			return fmt.Errorf("%s is outside this token's org: %w", t.What, ErrDenied)
		}
		return nil
	case ScopeTeam:
		if t.Platform {
			return fmt.Errorf("%s needs a platform-scoped token: %w", t.What, ErrDenied)
		}
		if t.OrgID != p.OrgID || t.TeamID == "" || t.TeamID != p.TeamID {
			return fmt.Errorf("%s is outside this token's team: %w", t.What, ErrDenied)
		}
		return nil
	}
	return fmt.Errorf("unknown scope: %w", ErrDenied)
}

// CanGrant reports whether p may create a token with the given scope and
// role: only admins, never beyond their own scope or role.
func CanGrant(ctx context.Context, p *Principal, scope Scope, orgID, teamID string, role Role) error {
	var t Target
	switch scope {
	case ScopePlatform:
		t = PlatformTarget("a platform token")
	case ScopeOrg:
		t = OrgTarget(orgID, "a token for org "+orgID)
	case ScopeTeam:
		t = TeamTarget(orgID, teamID, "a token for team "+teamID)
	default:
		markChecked(ctx)
		return fmt.Errorf("unknown scope: %w", ErrDenied)
	}
	if err := Check(ctx, p, ManageTokens, t); err != nil {
		return err
	}
	if role > p.Role {
		return fmt.Errorf("cannot grant role %s above own role %s: %w", role, p.Role, ErrDenied)
	}
	return nil
}

// Filter is the tenant filter a principal's reads are confined to: empty
// fields mean "any".
type Filter struct {
	OrgID  string
	TeamID string
}

// FilterFor returns the filter for p's scope.
func FilterFor(p *Principal) Filter {
	switch p.Scope {
	case ScopeOrg:
		return Filter{OrgID: p.OrgID}
	case ScopeTeam:
		return Filter{OrgID: p.OrgID, TeamID: p.TeamID}
	}
	return Filter{}
}

type principalKey struct{}
type checkedKey struct{}

// WithPrincipal returns ctx carrying p.
func WithPrincipal(ctx context.Context, p *Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// FromContext returns the principal of ctx, or nil.
func FromContext(ctx context.Context) *Principal {
	p, _ := ctx.Value(principalKey{}).(*Principal)
	return p
}

// WithCheckTracking returns ctx that records whether Check was called, and
// the function that tells.
func WithCheckTracking(ctx context.Context) (context.Context, func() bool) {
	var flag atomic.Bool
	return context.WithValue(ctx, checkedKey{}, &flag), flag.Load
}

func markChecked(ctx context.Context) {
	if f, ok := ctx.Value(checkedKey{}).(*atomic.Bool); ok {
		f.Store(true)
	}
}

// MarkChecked records that the handler decided access by other means
// (WhoAmI, which describes the caller itself).
func MarkChecked(ctx context.Context) { markChecked(ctx) }
