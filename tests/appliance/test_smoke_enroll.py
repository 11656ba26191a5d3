def test_mint_enroll_heartbeat_round_trip(control_plane):
    minted = control_plane.mint()
    enrolled = control_plane.enroll(minted["token"])
    assert enrolled.status_code == 201, enrolled.text
    body = enrolled.json()
    beat = control_plane.heartbeat(body["credential"], body["node_id"])
    assert beat.status_code == 200, beat.text
    assert beat.json()["compatibility"] == "COMPATIBLE"
