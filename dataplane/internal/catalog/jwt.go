package catalog

import (
	"strings"
	"sync"

	"github.com/sluicegw/sluice/dataplane/internal/authn"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// identIndex indexes what JWT claims name: trusted issuers by "iss", teams
// by (org, name) and users by (org, e-mail). A catalog is immutable, so the
// index is built once, on the first JWT request it serves; Apply gives the
// new catalog a fresh index only when teams, users or issuers change.
type identIndex struct {
	once     sync.Once
	byIss    map[string][]*configv1.TrustedIssuer
	teamName map[customerKey]string // (org, name) → team id
	email    map[customerKey]string // (org, e-mail) → user id
}

func (c *Catalog) identIndex() *identIndex {
	x := c.idents
	if x == nil {
		x = &identIndex{} // a catalog not built by FromSnapshot
	}
	x.once.Do(func() {
		x.byIss = make(map[string][]*configv1.TrustedIssuer, len(c.issuers))
		for _, ti := range c.issuers {
			x.byIss[ti.GetIssuer()] = append(x.byIss[ti.GetIssuer()], ti)
		}
		x.teamName = make(map[customerKey]string, len(c.teams))
		for _, t := range c.teams {
			if t.GetName() != "" {
				x.teamName[customerKey{t.GetOrgId(), t.GetName()}] = t.GetId()
			}
		}
		x.email = make(map[customerKey]string, len(c.users))
		for _, u := range c.users {
			if u.GetEmail() != "" {
				x.email[customerKey{u.GetOrgId(), strings.ToLower(u.GetEmail())}] = u.GetId()
			}
		}
	})
	return x
}

// TrustedIssuer returns the trusted issuer whose issuer is iss and whose
// audience is one of aud (nil when none is). The control plane keeps
// (issuer, audience) unique across orgs.
func (c *Catalog) TrustedIssuer(iss string, aud []string) *configv1.TrustedIssuer {
	for _, ti := range c.identIndex().byIss[iss] {
		for _, a := range aud {
			if a == ti.GetAudience() {
				return ti
			}
		}
	}
	return nil
}

// HasIssuer reports whether some org trusts iss (whatever the audience).
func (c *Catalog) HasIssuer(iss string) bool { return len(c.identIndex().byIss[iss]) > 0 }

// JWTPrincipal maps a verified token's identity to the org's team and
// user (team by name, else id; user by e-mail, else id; both within the
// issuer's org) under the issuer's policy for unknown ones, and checks
// the block state of org, team and user as key authentication does. The
// principal's Key is a synthetic key without limits of its own, id
// "jwt:<issuer id>", so that every stage after authentication treats the
// request as one of the mapped team and user.
func (c *Catalog) JWTPrincipal(ti *configv1.TrustedIssuer, id authn.Identity) (*Principal, error) {
	org := c.orgs[ti.GetOrgId()]
	if org == nil {
		return nil, authn.ErrUnknown
	}
	x := c.identIndex()
	orgID := org.GetId()
	lenient := ti.GetUnknownPolicy() == configv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_DEFAULT_TEAM
	p := &Principal{Org: org, Subject: id.Subject, Customer: id.Customer}
	if id.Team != "" {
		tid := x.teamName[customerKey{orgID, id.Team}]
		if tid == "" {
			tid = id.Team
		}
		if t := c.teams[tid]; t != nil && t.GetOrgId() == orgID {
			p.Team = t
		}
	}
	if p.Team == nil {
		if id.Team != "" || ti.GetTeamClaim() != "" {
			if !lenient {
				return nil, authn.ErrUnknownTeam
			}
		}
		if p.Team = c.teams[ti.GetDefaultTeamId()]; p.Team == nil || p.Team.GetOrgId() != orgID {
			return nil, authn.ErrUnknownTeam // default team deleted
		}
	}
	if ti.GetUserClaim() != "" {
		uid := x.email[customerKey{orgID, strings.ToLower(id.User)}]
		if uid == "" {
			uid = id.User
		}
		if u := c.users[uid]; id.User != "" && u != nil && u.GetOrgId() == orgID {
			p.User = u
			p.Member = c.members[memberKey{p.Team.GetId(), u.GetId()}]
		} else if !lenient {
			return nil, authn.ErrUnknownUser
		}
	}
	// The project and tags mapped from the token's claims: its requests
	// are limited by the org's project and tag scopes like a key's
	// (LabelScopes) and use the tag pool its tags pick.
	p.Key = &configv1.Key{Id: "jwt:" + ti.GetId(), OrgId: orgID, TeamId: p.Team.GetId(), UserId: p.User.GetId(),
		Project: id.Project, Tags: id.Tags}
	switch {
	case org.GetBlocked():
		return p, &authn.BlockedError{Scope: authn.ScopeOrg}
	case p.Team.GetBlocked():
		return p, &authn.BlockedError{Scope: authn.ScopeTeam}
	case p.User != nil && p.User.GetBlocked():
		return p, &authn.BlockedError{Scope: authn.ScopeUser}
	}
	return p, nil
}
