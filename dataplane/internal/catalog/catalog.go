// Package catalog is the data plane's immutable view of one configuration:
// a snapshot plus the events applied on top of it (SPEC §6). A request
// captures the current *Catalog once (through an atomic pointer held by
// configsync) and reads it without locks; applying an event returns a new
// Catalog that shares every map it did not change.
//
// Block state is resolved at lookup time from the maps (key → user → team
// → org), so blocking an org is one small map update, not a rewrite of
// every key of the org.
package catalog

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/dataplane/internal/authn"
	"github.com/sluicegw/sluice/internal/token"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

type memberKey struct{ team, user string }

// customerKey names an end customer the way requests do: the key's org
// and the external id the client sends (x-sluice-end-user).
type customerKey struct{ org, externalID string }

// labelKey names a project or tag scope the way keys do: the key's org,
// the kind ("project" or "tag") and the label.
type labelKey struct{ org, kind, name string }

// hashEntry points a token hash at a key.
type hashEntry struct {
	keyID         string
	pepperVersion int32
	validUntil    time.Time // zero for the current hash
}

// Catalog is one immutable configuration.
type Catalog struct {
	// Version is the snapshot version it was built from.
	Version uint64
	// EventsSeq is the last event (outbox seq) it includes.
	EventsSeq uint64
	// RegionSeq is the last region-stream position applied.
	RegionSeq uint64
	// CreatedAt is the snapshot's creation time.
	CreatedAt time.Time

	orgs      map[string]*configv1.Org
	teams     map[string]*configv1.Team
	users     map[string]*configv1.User
	members   map[memberKey]*configv1.Member
	customers map[string]*configv1.Customer
	// byExternal indexes the customers map by (org, external id), unique
	// per org in the control plane; it is updated with every change of
	// customers, copy-on-write like the other maps.
	byExternal map[customerKey]*configv1.Customer
	keys       map[string]*configv1.Key
	byHash     map[string]hashEntry
	// labels are the project and tag scopes by id; byLabel indexes them by
	// (org, kind, name), unique in the control plane and immutable there,
	// updated with every change of labels (copy-on-write).
	labels  map[string]*configv1.LabelScope
	byLabel map[labelKey]*configv1.LabelScope

	groups map[string]*configv1.ModelGroup
	// granted indexes each group's granted_org_ids as a set (built with
	// the group, replaced with it), so the grant check of a request is
	// two map lookups however many orgs a group is granted to.
	granted     map[string]map[string]struct{}
	deployments map[string]*Deployment
	open        OpenFunc
	// policies holds each org's compiled traffic settings (traffic.go),
	// rebuilt for an org whenever its record changes.
	policies map[string]*TrafficPolicy

	// issuers are the trusted JWT issuers by id; idents indexes them and
	// the teams' names and users' e-mails (built on first use, replaced
	// whenever one of them changes; jwt.go).
	issuers map[string]*configv1.TrustedIssuer
	idents  *identIndex
}

// OpenFunc decrypts a deployment credential sealed by the control plane's
// key ring.
type OpenFunc func(ciphertext []byte) ([]byte, error)

// Deployment is an upstream engine with its credential decrypted.
type Deployment struct {
	*configv1.Deployment
	// Credential is the decrypted upstream credential ("" for none).
	Credential string
	// CredentialErr is set when the credential could not be decrypted:
	// the deployment must not be used (and this must be reported).
	CredentialErr error
}

func newDeployment(d *configv1.Deployment, open OpenFunc) *Deployment {
	out := &Deployment{Deployment: d}
	if len(d.GetCredentialCiphertext()) == 0 {
		return out
	}
	if open == nil {
		out.CredentialErr = errors.New("no key ring configured (SLUICE_KEK) to decrypt the credential")
		return out
	}
	pt, err := open(d.GetCredentialCiphertext())
	if err != nil {
		out.CredentialErr = fmt.Errorf("decrypt credential of deployment %s: %w", d.GetId(), err)
		return out
	}
	out.Credential = string(pt)
	return out
}

// FromSnapshot builds a catalog. regionSeq is the region stream position
// the snapshot corresponds to (from its pointer); open decrypts deployment
// credentials (nil: deployments with a credential are unavailable).
func FromSnapshot(s *configv1.Snapshot, regionSeq uint64, open OpenFunc) (*Catalog, error) {
	c := &Catalog{
		open: open, groups: make(map[string]*configv1.ModelGroup, len(s.ModelGroups)),
		deployments: make(map[string]*Deployment, len(s.Deployments)),
		Version:     s.GetVersion(), EventsSeq: s.GetEventsSeq(), RegionSeq: regionSeq, CreatedAt: s.GetCreatedAt().AsTime(),
		orgs: make(map[string]*configv1.Org, len(s.Orgs)), teams: make(map[string]*configv1.Team, len(s.Teams)),
		users: make(map[string]*configv1.User, len(s.Users)), members: make(map[memberKey]*configv1.Member, len(s.Members)),
		customers: make(map[string]*configv1.Customer, len(s.Customers)), keys: make(map[string]*configv1.Key, len(s.Keys)),
		byExternal: make(map[customerKey]*configv1.Customer, len(s.Customers)),
		byHash:     make(map[string]hashEntry, len(s.Keys)),
		labels:     make(map[string]*configv1.LabelScope, len(s.LabelScopes)),
		byLabel:    make(map[labelKey]*configv1.LabelScope, len(s.LabelScopes)),
		issuers:    make(map[string]*configv1.TrustedIssuer, len(s.TrustedIssuers)),
		idents:     &identIndex{},
	}
	for _, ti := range s.TrustedIssuers {
		c.issuers[ti.GetId()] = ti
	}
	c.policies = make(map[string]*TrafficPolicy, len(s.Orgs))
	for _, o := range s.Orgs {
		c.orgs[o.GetId()] = o
		c.policies[o.GetId()] = compileTraffic(o)
	}
	for _, t := range s.Teams {
		c.teams[t.GetId()] = t
	}
	for _, u := range s.Users {
		c.users[u.GetId()] = u
	}
	for _, m := range s.Members {
		c.members[memberKey{m.GetTeamId(), m.GetUserId()}] = m
	}
	for _, cu := range s.Customers {
		c.putCustomer(c.customers[cu.GetId()], cu)
	}
	for _, ls := range s.LabelScopes {
		c.putLabel(c.labels[ls.GetId()], ls)
	}
	c.granted = make(map[string]map[string]struct{}, len(s.ModelGroups))
	for _, g := range s.ModelGroups {
		c.groups[g.GetName()] = g
		c.granted[g.GetName()] = grantSet(g)
	}
	for _, d := range s.Deployments {
		c.deployments[d.GetId()] = newDeployment(d, open)
	}
	for _, k := range s.Keys {
		if len(k.GetHash()) != 32 {
			return nil, fmt.Errorf("key %s has a %d-byte hash, want 32", k.GetId(), len(k.GetHash()))
		}
		if _, dup := c.byHash[string(k.GetHash())]; dup {
			return nil, fmt.Errorf("key %s: duplicate token hash", k.GetId())
		}
		c.keys[k.GetId()] = k
		indexKey(c.byHash, k)
	}
	return c, nil
}

func customerKeyOf(cu *configv1.Customer) customerKey {
	return customerKey{cu.GetOrgId(), cu.GetExternalId()}
}

// putCustomer sets cu in n's customer maps, which must be n's own copies,
// dropping the index entry of the version it replaces (old, if any).
func (n *Catalog) putCustomer(old, cu *configv1.Customer) {
	if old != nil {
		n.dropCustomerIndex(old)
	}
	n.customers[cu.GetId()] = cu
	n.byExternal[customerKeyOf(cu)] = cu
}

// dropCustomerIndex removes old's index entry if it still points at old's
// id (another customer may have taken the external id since).
func (n *Catalog) dropCustomerIndex(old *configv1.Customer) {
	k := customerKeyOf(old)
	if cur := n.byExternal[k]; cur != nil && cur.GetId() == old.GetId() {
		delete(n.byExternal, k)
	}
}

func labelKeyOf(ls *configv1.LabelScope) labelKey {
	return labelKey{ls.GetOrgId(), ls.GetKind(), ls.GetName()}
}

// putLabel sets ls in n's label maps, which must be n's own copies,
// dropping the index entry of the version it replaces (old, if any).
func (n *Catalog) putLabel(old, ls *configv1.LabelScope) {
	if old != nil {
		n.dropLabelIndex(old)
	}
	n.labels[ls.GetId()] = ls
	n.byLabel[labelKeyOf(ls)] = ls
}

// dropLabelIndex removes old's index entry if it still points at old's id.
func (n *Catalog) dropLabelIndex(old *configv1.LabelScope) {
	k := labelKeyOf(old)
	if cur := n.byLabel[k]; cur != nil && cur.GetId() == old.GetId() {
		delete(n.byLabel, k)
	}
}

func indexKey(byHash map[string]hashEntry, k *configv1.Key) {
	for _, o := range k.GetOldHashes() {
		byHash[string(o.GetHash())] = hashEntry{keyID: k.GetId(), pepperVersion: o.GetPepperVersion(), validUntil: o.GetValidUntil().AsTime()}
	}
	byHash[string(k.GetHash())] = hashEntry{keyID: k.GetId(), pepperVersion: k.GetPepperVersion()}
}

func unindexKey(byHash map[string]hashEntry, k *configv1.Key) {
	for _, o := range k.GetOldHashes() {
		if e, ok := byHash[string(o.GetHash())]; ok && e.keyID == k.GetId() {
			delete(byHash, string(o.GetHash()))
		}
	}
	if e, ok := byHash[string(k.GetHash())]; ok && e.keyID == k.GetId() {
		delete(byHash, string(k.GetHash()))
	}
}

// Counts returns the number of objects of each kind (for metrics and tests).
func (c *Catalog) Counts() map[string]int {
	return map[string]int{"orgs": len(c.orgs), "teams": len(c.teams), "users": len(c.users),
		"members": len(c.members), "customers": len(c.customers), "keys": len(c.keys),
		"model_groups": len(c.groups), "deployments": len(c.deployments), "trusted_issuers": len(c.issuers),
		"label_scopes": len(c.labels)}
}

// ErrUnknownChange is returned for an event this build cannot apply.
var ErrUnknownChange = errors.New("event carries no change this build understands")

// Apply returns a new catalog with ev applied at regionSeq. The receiver
// is not modified.
func (c *Catalog) Apply(ev *configv1.Event, regionSeq uint64) (*Catalog, error) {
	n := *c
	n.RegionSeq = regionSeq
	if ev.GetSeq() > n.EventsSeq {
		n.EventsSeq = ev.GetSeq()
	}
	switch ev.GetChange().(type) {
	case *configv1.Event_Team, *configv1.Event_TeamDeleted, *configv1.Event_User, *configv1.Event_UserDeleted,
		*configv1.Event_TrustedIssuer, *configv1.Event_TrustedIssuerDeleted:
		n.idents = &identIndex{} // names, e-mails or issuers changed
	}
	switch ch := ev.GetChange().(type) {
	case *configv1.Event_TrustedIssuer:
		n.issuers = maps.Clone(c.issuers)
		n.issuers[ch.TrustedIssuer.GetId()] = ch.TrustedIssuer
	case *configv1.Event_TrustedIssuerDeleted:
		n.issuers = maps.Clone(c.issuers)
		delete(n.issuers, ch.TrustedIssuerDeleted)
	case *configv1.Event_Org:
		n.orgs = maps.Clone(c.orgs)
		n.orgs[ch.Org.GetId()] = ch.Org
		n.policies = maps.Clone(c.policies)
		n.policies[ch.Org.GetId()] = compileTraffic(ch.Org)
	case *configv1.Event_OrgDeleted:
		n.orgs = maps.Clone(c.orgs)
		delete(n.orgs, ch.OrgDeleted)
		n.policies = maps.Clone(c.policies)
		delete(n.policies, ch.OrgDeleted)
	case *configv1.Event_Team:
		n.teams = maps.Clone(c.teams)
		n.teams[ch.Team.GetId()] = ch.Team
	case *configv1.Event_TeamDeleted:
		n.teams = maps.Clone(c.teams)
		delete(n.teams, ch.TeamDeleted)
		n.members = maps.Clone(c.members)
		for k := range n.members {
			if k.team == ch.TeamDeleted {
				delete(n.members, k)
			}
		}
	case *configv1.Event_User:
		n.users = maps.Clone(c.users)
		n.users[ch.User.GetId()] = ch.User
	case *configv1.Event_UserDeleted:
		n.users = maps.Clone(c.users)
		delete(n.users, ch.UserDeleted)
		n.members = maps.Clone(c.members)
		for k := range n.members {
			if k.user == ch.UserDeleted {
				delete(n.members, k)
			}
		}
	case *configv1.Event_Member:
		n.members = maps.Clone(c.members)
		n.members[memberKey{ch.Member.GetTeamId(), ch.Member.GetUserId()}] = ch.Member
	case *configv1.Event_MemberDeleted:
		n.members = maps.Clone(c.members)
		delete(n.members, memberKey{ch.MemberDeleted.GetTeamId(), ch.MemberDeleted.GetUserId()})
	case *configv1.Event_Customer:
		n.customers, n.byExternal = maps.Clone(c.customers), maps.Clone(c.byExternal)
		n.putCustomer(c.customers[ch.Customer.GetId()], ch.Customer)
	case *configv1.Event_CustomerDeleted:
		if old := c.customers[ch.CustomerDeleted]; old != nil {
			n.customers, n.byExternal = maps.Clone(c.customers), maps.Clone(c.byExternal)
			n.dropCustomerIndex(old)
			delete(n.customers, ch.CustomerDeleted)
		}
	case *configv1.Event_LabelScope:
		n.labels, n.byLabel = maps.Clone(c.labels), maps.Clone(c.byLabel)
		n.putLabel(c.labels[ch.LabelScope.GetId()], ch.LabelScope)
	case *configv1.Event_LabelScopeDeleted:
		if old := c.labels[ch.LabelScopeDeleted]; old != nil {
			n.labels, n.byLabel = maps.Clone(c.labels), maps.Clone(c.byLabel)
			n.dropLabelIndex(old)
			delete(n.labels, ch.LabelScopeDeleted)
		}
	case *configv1.Event_Key:
		if len(ch.Key.GetHash()) != 32 {
			return nil, fmt.Errorf("key %s has a %d-byte hash, want 32", ch.Key.GetId(), len(ch.Key.GetHash()))
		}
		n.keys = maps.Clone(c.keys)
		n.byHash = maps.Clone(c.byHash)
		if old := c.keys[ch.Key.GetId()]; old != nil {
			unindexKey(n.byHash, old)
		}
		n.keys[ch.Key.GetId()] = ch.Key
		indexKey(n.byHash, ch.Key)
	case *configv1.Event_KeyDeleted:
		if old := c.keys[ch.KeyDeleted]; old != nil {
			n.keys = maps.Clone(c.keys)
			n.byHash = maps.Clone(c.byHash)
			unindexKey(n.byHash, old)
			delete(n.keys, ch.KeyDeleted)
		}
	case *configv1.Event_Block:
		if err := n.applyBlock(c, ch.Block); err != nil {
			return nil, err
		}
	case *configv1.Event_ModelGroup:
		n.groups = maps.Clone(c.groups)
		n.groups[ch.ModelGroup.GetName()] = ch.ModelGroup
		n.granted = maps.Clone(c.granted)
		n.granted[ch.ModelGroup.GetName()] = grantSet(ch.ModelGroup)
	case *configv1.Event_ModelGroupDeleted:
		n.groups = maps.Clone(c.groups)
		delete(n.groups, ch.ModelGroupDeleted)
		n.granted = maps.Clone(c.granted)
		delete(n.granted, ch.ModelGroupDeleted)
	case *configv1.Event_Deployment:
		n.deployments = maps.Clone(c.deployments)
		n.deployments[ch.Deployment.GetId()] = newDeployment(ch.Deployment, c.open)
	case *configv1.Event_DeploymentDeleted:
		n.deployments = maps.Clone(c.deployments)
		delete(n.deployments, ch.DeploymentDeleted)
	default:
		return nil, fmt.Errorf("%w (event %d, kind %q)", ErrUnknownChange, ev.GetSeq(), ev.GetKind())
	}
	return &n, nil
}

// applyBlock replaces the blocked object with a copy whose Blocked is the
// event's (every other field, created_at included, kept as it was).
func (n *Catalog) applyBlock(c *Catalog, b *configv1.BlockChange) error {
	id, blocked := b.GetId(), b.GetBlocked()
	switch b.GetObjectType() {
	case "org":
		if o := c.orgs[id]; o != nil {
			n.orgs = maps.Clone(c.orgs)
			no := proto.CloneOf(o)
			no.Blocked = blocked
			n.orgs[id] = no
		}
	case "team":
		if t := c.teams[id]; t != nil {
			n.teams = maps.Clone(c.teams)
			nt := proto.CloneOf(t)
			nt.Blocked = blocked
			n.teams[id] = nt
		}
	case "user":
		if u := c.users[id]; u != nil {
			n.users = maps.Clone(c.users)
			nu := proto.CloneOf(u)
			nu.Blocked = blocked
			n.users[id] = nu
		}
	case "customer":
		if cu := c.customers[id]; cu != nil {
			n.customers, n.byExternal = maps.Clone(c.customers), maps.Clone(c.byExternal)
			nc := proto.CloneOf(cu)
			nc.Blocked = blocked
			n.putCustomer(cu, nc)
		}
	case "key":
		if k := c.keys[id]; k != nil {
			n.keys = maps.Clone(c.keys)
			nk := cloneKey(k)
			nk.Blocked = blocked
			n.keys[id] = nk
		}
	default:
		return fmt.Errorf("block of unknown object type %q", b.GetObjectType())
	}
	return nil
}

func cloneKey(k *configv1.Key) *configv1.Key {
	return &configv1.Key{
		Id: k.Id, OrgId: k.OrgId, TeamId: k.TeamId, UserId: k.UserId, Project: k.Project, Alias: k.Alias,
		Hash: k.Hash, PepperVersion: k.PepperVersion, ExpireTime: k.ExpireTime, Tags: k.Tags,
		TrafficClass: k.TrafficClass, ModelGroupAliases: k.ModelGroupAliases, EnforcedParams: k.EnforcedParams,
		AllowedRoutes: k.AllowedRoutes, Limits: k.Limits, Blocked: k.Blocked, OldHashes: k.OldHashes, Fallbacks: k.Fallbacks,
	}
}

// Principal is an authenticated key with its chain (declared by package
// authn, which authenticates requests over the catalog).
type Principal = authn.Principal

// Authenticate finds the key of tok at time now: shape and checksum first
// (authn.ErrMalformed, before any lookup), then the hash under every
// pepper version (authn.ErrUnknown), expiry (authn.ErrExpired) and the
// block state of key, user, team and org (*authn.BlockedError naming the
// widest blocked scope). With ErrExpired and BlockedError the principal is
// returned too, for attribution.
func (c *Catalog) Authenticate(peppers *token.Peppers, tok string, now time.Time) (*Principal, error) {
	if err := token.Check(token.KeyPrefix, tok); err != nil {
		return nil, fmt.Errorf("%w: %w", authn.ErrMalformed, err)
	}
	for _, cand := range peppers.Candidates(tok) {
		e, ok := c.byHash[string(cand.Hash)]
		if !ok || int(e.pepperVersion) != cand.Version {
			continue
		}
		k := c.keys[e.keyID]
		if k == nil {
			continue
		}
		stored := k.GetHash()
		if !e.validUntil.IsZero() {
			if !now.Before(e.validUntil) {
				return nil, authn.ErrUnknown // rotated out, grace over
			}
			stored = cand.Hash // found through an old hash: the map key matched exactly
		}
		if !token.Equal(stored, cand.Hash) {
			continue
		}
		return c.keyPrincipal(k, now)
	}
	return nil, authn.ErrUnknown
}

// KeyPrincipal is the principal of the key with id keyID at now, with
// the checks Authenticate makes once a token matched (expiry, blocks,
// missing parents), for explaining a key's decisions without its token.
func (c *Catalog) KeyPrincipal(keyID string, now time.Time) (*Principal, error) {
	k := c.keys[keyID]
	if k == nil {
		return nil, authn.ErrUnknown
	}
	return c.keyPrincipal(k, now)
}

// keyPrincipal builds k's principal and checks it at now.
func (c *Catalog) keyPrincipal(k *configv1.Key, now time.Time) (*Principal, error) {
	org := c.orgs[k.GetOrgId()]
	if org == nil {
		return nil, authn.ErrUnknown // org deleted
	}
	p := &Principal{Key: k, Org: org}
	if k.GetTeamId() != "" {
		if p.Team = c.teams[k.GetTeamId()]; p.Team == nil {
			return nil, authn.ErrUnknown
		}
	}
	if k.GetUserId() != "" {
		if p.User = c.users[k.GetUserId()]; p.User == nil {
			return nil, authn.ErrUnknown
		}
		if k.GetTeamId() != "" {
			p.Member = c.members[memberKey{k.GetTeamId(), k.GetUserId()}]
		}
	}
	if exp := k.GetExpireTime(); exp != nil && !now.Before(exp.AsTime()) {
		return p, authn.ErrExpired
	}
	switch {
	case org.GetBlocked():
		return p, &authn.BlockedError{Scope: authn.ScopeOrg}
	case p.Team != nil && p.Team.GetBlocked():
		return p, &authn.BlockedError{Scope: authn.ScopeTeam}
	case p.User != nil && p.User.GetBlocked():
		return p, &authn.BlockedError{Scope: authn.ScopeUser}
	case k.GetBlocked():
		return p, &authn.BlockedError{Scope: authn.ScopeKey}
	}
	return p, nil
}

// Equal reports whether two catalogs hold the same configuration (ignoring
// version bookkeeping); tests compare a data plane's catalog with a fresh
// snapshot this way.
func (c *Catalog) Equal(o *Catalog) error {
	if err := eqMaps("org", c.orgs, o.orgs); err != nil {
		return err
	}
	if err := eqMaps("team", c.teams, o.teams); err != nil {
		return err
	}
	if err := eqMaps("user", c.users, o.users); err != nil {
		return err
	}
	if err := eqMaps("member", c.members, o.members); err != nil {
		return err
	}
	if err := eqMaps("customer", c.customers, o.customers); err != nil {
		return err
	}
	if err := eqMaps("label scope", c.labels, o.labels); err != nil {
		return err
	}
	if err := eqMaps("model group", c.groups, o.groups); err != nil {
		return err
	}
	if err := eqMaps("trusted issuer", c.issuers, o.issuers); err != nil {
		return err
	}
	if len(c.deployments) != len(o.deployments) {
		return fmt.Errorf("%d deployments, want %d", len(c.deployments), len(o.deployments))
	}
	for id, d := range c.deployments {
		od, ok := o.deployments[id]
		if !ok || !proto.Equal(d.Deployment, od.Deployment) {
			return fmt.Errorf("deployment %s differs", id)
		}
	}
	return eqMaps("key", c.keys, o.keys)
}

// Customer returns the end customer of org orgID whose external id (the
// x-sluice-end-user value) is externalID, or nil when the org has no such
// customer. Unknown customers are not an error: the header is for
// attribution, and only a known, blocked customer is refused.
func (c *Catalog) Customer(orgID, externalID string) *configv1.Customer {
	return c.byExternal[customerKey{orgID, externalID}]
}

// Label scope kinds (configv1.LabelScope.kind).
const (
	LabelProject = "project"
	LabelTag     = "tag"
)

// LabelScopes returns the project and tag scopes that limit key k: the
// scope of its project and those of its tags, in that order (tags in the
// key's order; a key's tags are unique). Labels without a scope are left
// out; a key without any gets nil.
func (c *Catalog) LabelScopes(k *configv1.Key) []*configv1.LabelScope {
	if len(c.byLabel) == 0 {
		return nil
	}
	var out []*configv1.LabelScope
	org := k.GetOrgId()
	if p := k.GetProject(); p != "" {
		if ls := c.byLabel[labelKey{org, LabelProject, p}]; ls != nil {
			out = append(out, ls)
		}
	}
	for _, t := range k.GetTags() {
		if ls := c.byLabel[labelKey{org, LabelTag, t}]; ls != nil {
			out = append(out, ls)
		}
	}
	return out
}

// OrgIDs returns the ids of every org.
func (c *Catalog) OrgIDs() []string {
	out := make([]string, 0, len(c.orgs))
	for id := range c.orgs {
		out = append(out, id)
	}
	return out
}

// CreatedSince returns the orgs and deployments created at or after t
// (their created_at; those without one are not returned).
func (c *Catalog) CreatedSince(t time.Time) (orgs, deployments []string) {
	for id, o := range c.orgs {
		if ts := o.GetCreatedAt(); ts != nil && !ts.AsTime().Before(t) {
			orgs = append(orgs, id)
		}
	}
	for id, d := range c.deployments {
		if ts := d.GetCreatedAt(); ts != nil && !ts.AsTime().Before(t) {
			deployments = append(deployments, id)
		}
	}
	slices.Sort(orgs)
	slices.Sort(deployments)
	return orgs, deployments
}

// HasOrg reports whether the catalog holds the org.
func (c *Catalog) HasOrg(id string) bool { return c.orgs[id] != nil }

// HasDeployment reports whether the catalog holds the deployment.
func (c *Catalog) HasDeployment(id string) bool { return c.deployments[id] != nil }

// HasModelGroup reports whether the model group exists.
func (c *Catalog) HasModelGroup(name string) bool { return c.groups[name] != nil }

// ModelGroupVisible reports whether org orgID may use model group name:
// the group exists and is platform-wide or granted to the org
// (docs/tenancy.md).
func (c *Catalog) ModelGroupVisible(orgID, name string) bool {
	g := c.groups[name]
	if g == nil {
		return false
	}
	if g.GetPlatformWide() {
		return true
	}
	_, ok := c.granted[name][orgID]
	return ok
}

// grantSet is g's granted_org_ids as a set (nil for none).
func grantSet(g *configv1.ModelGroup) map[string]struct{} {
	ids := g.GetGrantedOrgIds()
	if len(ids) == 0 {
		return nil
	}
	out := make(map[string]struct{}, len(ids))
	for _, id := range ids {
		out[id] = struct{}{}
	}
	return out
}

// VisibleModelGroups returns the names of the model groups org orgID may
// use, sorted.
func (c *Catalog) VisibleModelGroups(orgID string) []string {
	out := make([]string, 0, len(c.groups))
	for n := range c.groups {
		if c.ModelGroupVisible(orgID, n) {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

// ModelGroups returns the model group names, sorted.
func (c *Catalog) ModelGroups() []string {
	out := make([]string, 0, len(c.groups))
	for n := range c.groups {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// Deployments returns the deployments of a model group, sorted by id
// (including those whose credential failed to decrypt: callers must skip
// and report them).
func (c *Catalog) Deployments(group string) []*Deployment {
	var out []*Deployment
	for _, d := range c.deployments {
		if d.GetModelGroup() == group {
			out = append(out, d)
		}
	}
	slices.SortFunc(out, func(a, b *Deployment) int { return strings.Compare(a.GetId(), b.GetId()) })
	return out
}

// AllDeployments returns every deployment, sorted by id.
func (c *Catalog) AllDeployments() []*Deployment {
	out := make([]*Deployment, 0, len(c.deployments))
	for _, d := range c.deployments {
		out = append(out, d)
	}
	slices.SortFunc(out, func(a, b *Deployment) int { return strings.Compare(a.GetId(), b.GetId()) })
	return out
}

// WithRegionSeq returns c at a later region-stream position with nothing
// else changed (for events the snapshot already holds).
func (c *Catalog) WithRegionSeq(regionSeq uint64) *Catalog {
	n := *c
	n.RegionSeq = regionSeq
	return &n
}
