// Package configmsg converts the store's objects to their wire form
// (sluice.config.v1), the one place both snapshots and events take them
// from. It is pure: no I/O, no clock (the caller passes now).
package configmsg

import (
	"fmt"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// limits converts stored limits (JSON of sluice.admin.v1.Limits, whose
// field names sluice.config.v1.Limits shares) to the wire type.
func limits(b []byte) (*configv1.Limits, error) {
	l := &configv1.Limits{}
	if len(b) == 0 {
		return l, nil
	}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: false}).Unmarshal(b, l); err != nil {
		return nil, fmt.Errorf("convert limits: %w", err)
	}
	return l, nil
}

func trafficClass(s string) configv1.TrafficClass {
	switch s {
	case "interactive":
		return configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE
	case "agent":
		return configv1.TrafficClass_TRAFFIC_CLASS_AGENT
	case "batch":
		return configv1.TrafficClass_TRAFFIC_CLASS_BATCH
	}
	return configv1.TrafficClass_TRAFFIC_CLASS_UNSPECIFIED
}

// traffic converts stored traffic settings (JSON of a sluice.admin.v1
// traffic message, whose field names the sluice.config.v1 one shares) into
// m. Empty or "{}" leaves m empty; the caller drops an empty message.
func traffic(b []byte, m proto.Message) (bool, error) {
	if len(b) == 0 {
		return false, nil
	}
	if err := protojson.Unmarshal(b, m); err != nil {
		return false, fmt.Errorf("convert traffic settings: %w", err)
	}
	return proto.Size(m) > 0, nil
}

// Org converts an org.
func Org(o store.Org) (*configv1.Org, error) {
	l, err := limits(o.Limits)
	if err != nil {
		return nil, err
	}
	m := &configv1.Org{Id: o.ID, Limits: l, Blocked: o.Blocked, CreatedAt: createdAt(o.CreatedAt)}
	t := &configv1.OrgTraffic{}
	if ok, err := traffic(o.Traffic, t); err != nil {
		return nil, fmt.Errorf("org %s: %w", o.ID, err)
	} else if ok {
		m.Traffic = t
	}
	return m, nil
}

// Team converts a team.
func Team(t store.Team) (*configv1.Team, error) {
	l, err := limits(t.Limits)
	if err != nil {
		return nil, err
	}
	return &configv1.Team{Id: t.ID, OrgId: t.OrgID, Limits: l, Blocked: t.Blocked, Name: t.Name,
		TrafficClass: trafficClass(t.TrafficClass), ModelGroupAliases: t.ModelGroupAliases, Fallbacks: fallbacks(t.Fallbacks)}, nil
}

// User converts a user.
func User(u store.User) (*configv1.User, error) {
	l, err := limits(u.Limits)
	if err != nil {
		return nil, err
	}
	return &configv1.User{Id: u.ID, OrgId: u.OrgID, Limits: l, Blocked: u.Blocked, Email: u.Email}, nil
}

// Member converts a team membership.
func Member(m store.TeamMember) (*configv1.Member, error) {
	l, err := limits(m.Limits)
	if err != nil {
		return nil, err
	}
	return &configv1.Member{TeamId: m.TeamID, UserId: m.UserID, OrgId: m.OrgID, MaxBudgetInTeam: m.MaxBudgetInTeam, Limits: l}, nil
}

// Customer converts a customer.
func Customer(c store.Customer) (*configv1.Customer, error) {
	l, err := limits(c.Limits)
	if err != nil {
		return nil, err
	}
	return &configv1.Customer{Id: c.ID, OrgId: c.OrgID, ExternalId: c.ExternalID, Limits: l, Blocked: c.Blocked}, nil
}

// LabelScope converts a project or tag scope.
func LabelScope(ls store.LabelScope) (*configv1.LabelScope, error) {
	l, err := limits(ls.Limits)
	if err != nil {
		return nil, err
	}
	return &configv1.LabelScope{Id: ls.ID, OrgId: ls.OrgID, Kind: ls.Kind, Name: ls.Name, Limits: l}, nil
}

// Key converts a key as of now: rotated-out hashes whose grace is over
// are left out.
func Key(k store.ConfigKey, now time.Time) (*configv1.Key, error) {
	l, err := limits(k.Limits)
	if err != nil {
		return nil, err
	}
	m := &configv1.Key{
		Id: k.ID, OrgId: k.OrgID, TeamId: k.TeamID, UserId: k.UserID, Project: k.Project, Alias: k.Alias,
		Hash: k.Hash, PepperVersion: int32(k.PepperVersion), Tags: k.Tags, TrafficClass: trafficClass(k.TrafficClass),
		ModelGroupAliases: k.ModelGroupAliases, EnforcedParams: k.EnforcedParams, AllowedRoutes: k.AllowedRoutes,
		Limits: l, Blocked: k.Blocked, Fallbacks: fallbacks(k.Fallbacks),
	}
	if k.ExpiresAt != nil {
		m.ExpireTime = timestamppb.New(*k.ExpiresAt)
	}
	for _, o := range k.OldHashes {
		if !o.ValidUntil.After(now) {
			continue // grace over: never ship a dead credential
		}
		m.OldHashes = append(m.OldHashes, &configv1.OldHash{Hash: o.Hash, PepperVersion: int32(o.PepperVersion), ValidUntil: timestamppb.New(o.ValidUntil)})
	}
	return m, nil
}

// ModelGroup converts a model group.
func ModelGroup(g store.ModelGroup) (*configv1.ModelGroup, error) {
	m := &configv1.ModelGroup{Name: g.Name, PlatformWide: g.PlatformWide, GrantedOrgIds: g.OrgIDs}
	t := &configv1.ModelGroupTraffic{}
	if ok, err := traffic(g.Traffic, t); err != nil {
		return nil, fmt.Errorf("model group %s: %w", g.Name, err)
	} else if ok {
		m.Traffic = t
	}
	r, err := routing(g.Routing)
	if err != nil {
		return nil, fmt.Errorf("model group %s: %w", g.Name, err)
	}
	m.Routing = r
	m.Fallbacks = g.Fallbacks
	res := &configv1.ModelGroupResilience{}
	if ok, err := traffic(g.Resilience, res); err != nil {
		return nil, fmt.Errorf("model group %s resilience: %w", g.Name, err)
	} else if ok {
		m.Resilience = res
	}
	return m, nil
}

// routing converts stored routing settings (JSON of
// sluice.admin.v1.ModelGroupRouting); nil when none are set.
func routing(b []byte) (*configv1.ModelGroupRouting, error) {
	a := &adminv1.ModelGroupRouting{}
	if len(b) == 0 {
		return nil, nil
	}
	if err := protojson.Unmarshal(b, a); err != nil {
		return nil, fmt.Errorf("convert routing settings: %w", err)
	}
	if proto.Size(a) == 0 {
		return nil, nil
	}
	return &configv1.ModelGroupRouting{Strategy: a.GetStrategy(), SessionTtlMs: a.GetSessionTtl().AsDuration().Milliseconds(),
		LoadFactor: a.GetLoadFactor()}, nil
}

// fallbacks converts per-group fallback overrides (nil for none).
func fallbacks(f store.Fallbacks) map[string]*configv1.ModelGroupFallbacks {
	if len(f) == 0 {
		return nil
	}
	out := make(map[string]*configv1.ModelGroupFallbacks, len(f))
	for g, list := range f {
		out[g] = &configv1.ModelGroupFallbacks{ModelGroups: list}
	}
	return out
}

// Deployment converts a deployment for the data planes. The credential
// travels as stored, sealed by the key ring: the control plane never
// decrypts it to publish.
func Deployment(d store.Deployment) (*configv1.Deployment, error) {
	c := d.Capabilities
	m := &configv1.Deployment{
		Id: d.ID, ModelGroup: d.ModelGroup, ApiBase: d.APIBase, UpstreamModel: d.UpstreamModel,
		CredentialCiphertext: d.CredentialCiphertext, Weight: d.Weight, MaxConcurrency: d.MaxConcurrency,
		Capabilities: &configv1.Capabilities{Tools: c.Tools, JsonMode: c.JSONMode, Vision: c.Vision,
			MaxInputTokens: c.MaxInputTokens, MaxOutputTokens: c.MaxOutputTokens, Protocols: c.Protocols},
		Tags: d.Tags,
		Prices: &configv1.Prices{InputPerToken: d.InputPrice, OutputPerToken: d.OutputPrice,
			CachedInputPerToken: d.CachedInputPrice},
		Free:      d.Free,
		CreatedAt: createdAt(d.CreatedAt),
	}
	t := &configv1.DeploymentTraffic{}
	if ok, err := traffic(d.Traffic, t); err != nil {
		return nil, fmt.Errorf("deployment %s: %w", d.ID, err)
	} else if ok {
		m.Traffic = t
	}
	return m, nil
}

// TrustedIssuer converts a trusted JWT issuer.
func TrustedIssuer(ti store.TrustedIssuer) *configv1.TrustedIssuer {
	policy := configv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_REFUSE
	if ti.UnknownPolicy == "default_team" {
		policy = configv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_DEFAULT_TEAM
	}
	return &configv1.TrustedIssuer{Id: ti.ID, OrgId: ti.OrgID, Issuer: ti.Issuer, Audience: ti.Audience, JwksUrl: ti.JWKSURL,
		TeamClaim: ti.TeamClaim, UserClaim: ti.UserClaim, CustomerClaim: ti.CustomerClaim,
		UnknownPolicy: policy, DefaultTeamId: ti.DefaultTeamID, ProjectClaim: ti.ProjectClaim, TagsClaim: ti.TagsClaim}
}

// createdAt is t for a message's created_at (nil when unknown).
func createdAt(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}
