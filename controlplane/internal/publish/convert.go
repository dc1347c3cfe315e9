package publish

import (
	"fmt"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
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

func orgMsg(o store.Org) (*configv1.Org, error) {
	l, err := limits(o.Limits)
	if err != nil {
		return nil, err
	}
	return &configv1.Org{Id: o.ID, Limits: l, Blocked: o.Blocked}, nil
}

func teamMsg(t store.Team) (*configv1.Team, error) {
	l, err := limits(t.Limits)
	if err != nil {
		return nil, err
	}
	return &configv1.Team{Id: t.ID, OrgId: t.OrgID, Limits: l, Blocked: t.Blocked,
		TrafficClass: trafficClass(t.TrafficClass), ModelGroupAliases: t.ModelGroupAliases}, nil
}

func userMsg(u store.User) (*configv1.User, error) {
	l, err := limits(u.Limits)
	if err != nil {
		return nil, err
	}
	return &configv1.User{Id: u.ID, OrgId: u.OrgID, Limits: l, Blocked: u.Blocked}, nil
}

func memberMsg(m store.TeamMember) (*configv1.Member, error) {
	l, err := limits(m.Limits)
	if err != nil {
		return nil, err
	}
	return &configv1.Member{TeamId: m.TeamID, UserId: m.UserID, OrgId: m.OrgID, MaxBudgetInTeam: m.MaxBudgetInTeam, Limits: l}, nil
}

func customerMsg(c store.Customer) (*configv1.Customer, error) {
	l, err := limits(c.Limits)
	if err != nil {
		return nil, err
	}
	return &configv1.Customer{Id: c.ID, OrgId: c.OrgID, ExternalId: c.ExternalID, Limits: l, Blocked: c.Blocked}, nil
}

func keyMsg(k store.ConfigKey, now time.Time) (*configv1.Key, error) {
	l, err := limits(k.Limits)
	if err != nil {
		return nil, err
	}
	m := &configv1.Key{
		Id: k.ID, OrgId: k.OrgID, TeamId: k.TeamID, UserId: k.UserID, Project: k.Project, Alias: k.Alias,
		Hash: k.Hash, PepperVersion: int32(k.PepperVersion), Tags: k.Tags, TrafficClass: trafficClass(k.TrafficClass),
		ModelGroupAliases: k.ModelGroupAliases, EnforcedParams: k.EnforcedParams, AllowedRoutes: k.AllowedRoutes,
		Limits: l, Blocked: k.Blocked,
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

func modelGroupMsg(g store.ModelGroup) *configv1.ModelGroup {
	return &configv1.ModelGroup{Name: g.Name}
}

// deploymentMsg converts a deployment for the data planes. The credential
// travels as stored, sealed by the key ring: the control plane never
// decrypts it to publish.
func deploymentMsg(d store.Deployment) *configv1.Deployment {
	c := d.Capabilities
	return &configv1.Deployment{
		Id: d.ID, ModelGroup: d.ModelGroup, ApiBase: d.APIBase, UpstreamModel: d.UpstreamModel,
		CredentialCiphertext: d.CredentialCiphertext, Weight: d.Weight, MaxConcurrency: d.MaxConcurrency,
		Capabilities: &configv1.Capabilities{Tools: c.Tools, JsonMode: c.JSONMode, Vision: c.Vision,
			MaxInputTokens: c.MaxInputTokens, MaxOutputTokens: c.MaxOutputTokens},
		Tags: d.Tags,
		Prices: &configv1.Prices{InputPerToken: d.InputPrice, OutputPerToken: d.OutputPrice,
			CachedInputPerToken: d.CachedInputPrice},
		Free: d.Free,
	}
}

// snapshotFrom builds the snapshot of st as version v.
func snapshotFrom(st store.ConfigState, v uint64, now time.Time) (*configv1.Snapshot, error) {
	s := &configv1.Snapshot{
		SchemaVersion: wire.SchemaVersion, Version: v, CreatedAt: timestamppb.New(now), EventsSeq: uint64(st.EventsSeq),
		Orgs: make([]*configv1.Org, 0, len(st.Orgs)), Teams: make([]*configv1.Team, 0, len(st.Teams)),
		Users: make([]*configv1.User, 0, len(st.Users)), Members: make([]*configv1.Member, 0, len(st.Members)),
		Customers: make([]*configv1.Customer, 0, len(st.Customers)), Keys: make([]*configv1.Key, 0, len(st.Keys)),
		ModelGroups: make([]*configv1.ModelGroup, 0, len(st.ModelGroups)), Deployments: make([]*configv1.Deployment, 0, len(st.Deployments)),
	}
	for _, o := range st.Orgs {
		m, err := orgMsg(o)
		if err != nil {
			return nil, err
		}
		s.Orgs = append(s.Orgs, m)
	}
	for _, t := range st.Teams {
		m, err := teamMsg(t)
		if err != nil {
			return nil, err
		}
		s.Teams = append(s.Teams, m)
	}
	for _, u := range st.Users {
		m, err := userMsg(u)
		if err != nil {
			return nil, err
		}
		s.Users = append(s.Users, m)
	}
	for _, mb := range st.Members {
		m, err := memberMsg(mb)
		if err != nil {
			return nil, err
		}
		s.Members = append(s.Members, m)
	}
	for _, c := range st.Customers {
		m, err := customerMsg(c)
		if err != nil {
			return nil, err
		}
		s.Customers = append(s.Customers, m)
	}
	for _, k := range st.Keys {
		m, err := keyMsg(k, now)
		if err != nil {
			return nil, err
		}
		s.Keys = append(s.Keys, m)
	}
	for _, g := range st.ModelGroups {
		s.ModelGroups = append(s.ModelGroups, modelGroupMsg(g))
	}
	for _, d := range st.Deployments {
		s.Deployments = append(s.Deployments, deploymentMsg(d))
	}
	return s, nil
}
