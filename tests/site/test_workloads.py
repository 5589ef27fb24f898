"""Workload visibility and sharing, through the one selector every view uses."""

from __future__ import annotations

from django.urls import reverse

from apps.workloads.models import Workload, WorkloadShare
from apps.workloads.selectors import workloads_visible_to


def test_user_sees_own_and_shared_workloads_only(personas):
    assert list(workloads_visible_to(personas.bob)) == [personas.workload]
    assert list(workloads_visible_to(personas.carol)) == [personas.other_workload]


def test_administrators_see_every_workload(personas):
    assert workloads_visible_to(personas.admin).count() == Workload.objects.count()


def test_deactivated_user_sees_nothing(personas):
    personas.alice.is_active = False
    assert not workloads_visible_to(personas.alice).exists()


def test_owner_shares_with_carol_who_then_sees_it(client, personas):
    client.force_login(personas.alice)
    url = reverse("api-workload-shares", args=[personas.workload.pk])
    assert client.post(url, {"username": "carol"}, content_type="application/json").status_code == 201
    assert personas.workload in workloads_visible_to(personas.carol)


def test_unshare_hides_the_workload_again(client, personas):
    client.force_login(personas.alice)
    client.delete(reverse("api-workload-share-detail", args=[personas.workload.pk, personas.bob.pk]))
    assert personas.workload not in workloads_visible_to(personas.bob)
    bob = client.__class__()
    bob.force_login(personas.bob)
    assert bob.get(reverse("workloads:detail", args=[personas.workload.pk])).status_code == 404


def test_read_share_cannot_reshare_but_manage_share_can(client, personas):
    client.force_login(personas.bob)
    url = reverse("api-workload-shares", args=[personas.workload.pk])
    assert client.post(url, {"username": "carol"}, content_type="application/json").status_code == 403
    WorkloadShare.objects.filter(user=personas.bob).update(level="manage")
    assert client.post(url, {"username": "carol"}, content_type="application/json").status_code == 201


def test_sharing_with_an_unknown_user_or_bad_level_changes_nothing(client, personas):
    client.force_login(personas.alice)
    url = reverse("api-workload-shares", args=[personas.workload.pk])
    assert client.post(url, {"username": "nobody"}, content_type="application/json").status_code == 400
    assert client.post(url, {"username": "carol", "level": "owner"}, content_type="application/json").status_code == 400
    assert WorkloadShare.objects.filter(workload=personas.workload).count() == 1


def test_empty_workload_list_tells_how_to_connect_an_agent(client, personas):
    client.force_login(personas.bob)
    WorkloadShare.objects.all().delete()
    page = client.get(reverse("workloads:list")).content.decode()
    assert "No workloads yet" in page
    assert "COMMINSIGHT_AGENT_SERVER_URL=http://testserver" in page
    assert "COMMINSIGHT_AGENT_TOKEN" in page


def test_owner_deletes_a_workload(client, personas):
    client.force_login(personas.alice)
    assert client.delete(reverse("api-workload-detail", args=[personas.workload.pk])).status_code == 204
    assert not Workload.objects.filter(pk=personas.workload.pk).exists()
